"""The coverage map as pure data: which serving nodes hold which layers of which model."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meshnet_common.layers import LayerRange


@dataclass(frozen=True)
class ServingNode:
    """A node as routing and placement see it (a snapshot, not the live record)."""

    node_id: str
    url: str
    model_id: str
    layers: LayerRange
    load: int = 0  # active sessions
    state: str = "serving"
    quantization: str = "bfloat16"  # its precision (resolved), compute dtype, int4 group
    dtype: str = "bfloat16"
    quant_group_size: int | None = None
    layer_ms: float | None = None  # decode compute per layer, as the node measured it
    links: tuple[tuple[str, float], ...] = ()  # (next hop URL, round trip ms) it measured
    # Its measured slowdown (docs/adr/0032): routes count its compute as claimed times this.
    slowdown: float = 1.0


@dataclass(frozen=True)
class ModelCoverage:
    """One model's coverage: its layer count and the nodes serving parts of it."""

    model_id: str
    num_layers: int
    nodes: tuple[ServingNode, ...]

    @property
    def serving(self) -> tuple[ServingNode, ...]:
        return tuple(n for n in self.nodes if n.state == "serving")

    def layer_counts(self) -> list[int]:
        """How many serving nodes hold each layer."""
        counts = [0] * self.num_layers
        for node in self.serving:
            for layer in range(node.layers.start, min(node.layers.end, self.num_layers)):
                counts[layer] += 1
        return counts

    def gaps(self) -> list[LayerRange]:
        """Maximal runs of layers no serving node holds."""
        gaps: list[LayerRange] = []
        start = None
        for layer, count in enumerate(self.layer_counts()):
            if count == 0 and start is None:
                start = layer
            elif count and start is not None:
                gaps.append(LayerRange(start, layer))
                start = None
        if start is not None:
            gaps.append(LayerRange(start, self.num_layers))
        return gaps

    @property
    def covered(self) -> bool:
        return not self.gaps()


def build_coverage(
    nodes: Iterable[ServingNode], num_layers: dict[str, int]
) -> dict[str, ModelCoverage]:
    """Group nodes by model; every model in ``num_layers`` appears, served or not."""
    by_model: dict[str, list[ServingNode]] = {m: [] for m in num_layers}
    for node in nodes:
        by_model.setdefault(node.model_id, []).append(node)
    return {
        model_id: ModelCoverage(
            model_id,
            num_layers.get(model_id, max((n.layers.end for n in members), default=0)),
            tuple(sorted(members, key=lambda n: (n.layers.start, n.layers.end, n.node_id))),
        )
        for model_id, members in sorted(by_model.items())
    }


def describe_gaps(gaps: list[LayerRange]) -> str:
    return ", ".join(str(g) for g in gaps)
