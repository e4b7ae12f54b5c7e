"""The tracker's live state: registry, known models and (optionally) its own node."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import httpx

from meshnet_common.checkpoint import CheckpointIndex
from meshnet_common.errors import ModelNotCovered, NotFound
from meshnet_common.memory import ModelCosts
from meshnet_common.models_dir import scan_models_dir
from meshnet_node.runtime import NodeRuntime
from meshnet_tracker.balancer import Balancer
from meshnet_tracker.coverage import ModelCoverage
from meshnet_tracker.registry import Registry
from meshnet_tracker.routing import Hop, choose_route
from meshnet_tracker.settings import TrackerSettings

logger = logging.getLogger(__name__)


@dataclass
class TrackerState:
    """Everything the tracker's routes need."""

    settings: TrackerSettings
    registry: Registry
    node: NodeRuntime | None
    client: httpx.AsyncClient
    costs: dict[str, ModelCosts] = field(default_factory=dict)  # models we can place nodes on
    demand: Counter = field(default_factory=Counter)  # requests per model
    balancer: Balancer = field(init=False)

    def __post_init__(self) -> None:
        self.balancer = Balancer(self.registry, self.costs, self.demand)

    def index_models_dir(self) -> None:
        """Make every model in the models dir known to the coverage map and to placement."""
        if self.settings.models_dir is None:
            return
        scan = scan_models_dir(self.settings.models_dir)
        for entry in scan.entries:
            self.registry.note_model(entry.model_id, entry.num_layers)
            self.costs[entry.model_id] = ModelCosts.from_index(CheckpointIndex.load(entry.path))
        for problem in scan.problems:
            logger.warning("models dir: %s", problem)

    def model(self, model_id: str) -> ModelCoverage:
        coverage = self.registry.coverage()
        if model_id not in coverage:
            raise NotFound(
                f"model {model_id!r} is unknown; known: {', '.join(coverage) or 'none'}",
                param="model",
                code="model_not_found",
            )
        return coverage[model_id]

    def route(
        self, model_id: str, *, head: str | None = None, exclude_urls: frozenset[str] = frozenset()
    ) -> list[Hop]:
        """A chain for ``model_id``; nodes at ``exclude_urls`` (failed hops) are avoided."""
        model = self.model(model_id)
        if not model.serving:
            raise ModelNotCovered(
                f"no node serves {model_id}; missing layers: [0, {model.num_layers})",
                code="model_not_covered",
            )
        exclude = {n.node_id for n in model.nodes if n.url in exclude_urls}
        return choose_route(model, head=head, exclude=exclude)
