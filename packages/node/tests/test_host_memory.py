"""Nodes sharing a host offer what the others have not claimed (files in a claims dir)."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from meshnet_node.swarm.host_memory import GIB, HostClaims


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_an_explicit_figure_is_used_as_given(tmp_path):
    offer = HostClaims(tmp_path).offer(2.5)
    assert offer.explicit and offer.bytes == int(2.5 * GIB)
    assert "--memory-gb" in offer.describe()


def test_a_later_node_offers_what_the_others_did_not_claim(tmp_path, sleeper):
    other = HostClaims(tmp_path, pid=sleeper.pid)
    other.claim(3 * GIB)
    me = HostClaims(tmp_path)
    claimed, count = me.others()
    rss = psutil.Process(sleeper.pid).memory_info().rss
    assert count == 1
    assert claimed == pytest.approx(3 * GIB - rss, abs=64 << 20)  # what it holds is not counted
    offer = me.offer(None)
    assert offer.bytes == max(0, offer.available - offer.others_bytes)
    assert offer.others == 1 and "1 other meshnet node" in offer.describe()
    me.claim(GIB)  # its own claim never counts against itself
    assert me.others()[1] == 1


def test_claims_of_dead_processes_are_ignored_and_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"{dead.pid}.json").write_text(json.dumps({"bytes": 5 * GIB}))
    (tmp_path / "junk.json").write_text("not json")
    assert HostClaims(tmp_path).others() == (0, 0)
    assert not (tmp_path / f"{dead.pid}.json").exists()


def test_release_removes_the_claim(tmp_path):
    me = HostClaims(tmp_path)
    me.claim(GIB)
    assert json.loads(me.path.read_text()) == {"bytes": GIB}
    me.release()
    assert not me.path.exists()
