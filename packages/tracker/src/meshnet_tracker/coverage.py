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


# A model no serving node holds and the models dir does not list leaves the model table
# this long after the last node holding it went (docs/adr/0032).
UNHELD_MODEL_TTL_S = 600.0


class ModelTable:
    """The layer count of each known model and where it came from (docs/adr/0032): the
    models dir (kept while listed), else the called-back node that introduced it, by the
    address it registered from; a model no serving node holds and the dir does not list is
    forgotten ``ttl_s`` after it was last held. Not locked: its owner locks."""

    def __init__(self, ttl_s: float = UNHELD_MODEL_TTL_S) -> None:
        self.ttl_s = ttl_s
        self.layers: dict[str, int] = {}
        self._listed: set[str] = set()  # in the models dir
        self._source: dict[str, str | None] = {}  # introduced by a node from this address
        self._held: dict[str, float] = {}  # when a serving node last held it

    def list_in_dir(self, model_id: str, num_layers: int) -> None:
        """The models dir holds it: its count is the dir's (it overrides a node's)."""
        self.layers[model_id] = num_layers
        self._listed.add(model_id)
        self._source.pop(model_id, None)

    def unlist_from_dir(self, model_id: str) -> None:
        """It left the models dir: nodes may hold it on, then it expires."""
        self._listed.discard(model_id)

    def introduce(self, model_id: str, num_layers: int, source: str | None, now: float) -> None:
        """A called-back serving node names a model (the table keeps the count it knows)."""
        if model_id not in self.layers:
            self.layers[model_id] = num_layers
            self._source[model_id] = source
        self._held[model_id] = now

    def introduced_by(self, source: str | None) -> int:
        """How many models of the table a node from ``source`` introduced."""
        return sum(1 for s in self._source.values() if s == source)

    def source_of(self, model_id: str) -> str | None:
        """The address of the node that introduced ``model_id`` (None: the models dir's)."""
        return self._source.get(model_id)

    def forget(self, model_id: str) -> bool:
        self._source.pop(model_id, None)
        self._held.pop(model_id, None)
        return self.layers.pop(model_id, None) is not None

    def held(self, model_id: str, now: float) -> None:
        """A serving node of ``model_id`` is (or was until) ``now``."""
        if model_id in self.layers:
            self._held[model_id] = now

    def expire(self, held: set[str], now: float) -> list[str]:
        """Note the models serving nodes hold now; forget the unlisted ones nothing held
        for ``ttl_s``. Returns the forgotten ones."""
        for model_id in held:
            self.held(model_id, now)
        gone = [
            m for m in self.layers
            if m not in self._listed and now - self._held.setdefault(m, now) > self.ttl_s
        ]  # fmt: skip
        for model_id in gone:
            self.forget(model_id)
        return gone
