"""Cross-service fixtures (the process harness lives in swarm_harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from swarm_harness import Swarm


@pytest.fixture
def swarm_factory(models_dir, tmp_path_factory):
    swarms: list[Swarm] = []

    def make(heartbeat_s: float = 0.5) -> Swarm:
        swarm = Swarm(Path(models_dir), tmp_path_factory.mktemp("swarm-logs"), heartbeat_s)
        swarms.append(swarm)
        return swarm

    yield make
    for swarm in swarms:
        swarm.close()
