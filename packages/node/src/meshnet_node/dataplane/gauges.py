"""A node's gauges (``/metrics``), read from its live stages at scrape time: a reshard
swaps the stages under them."""

from __future__ import annotations

from meshnet_node.dataplane.service import NodeService
from meshnet_node.engine.stage import Stage


def watch_service(service: NodeService) -> None:
    """Register the gauges of ``service``'s sessions, KV, tokens, batches and state."""

    def stages() -> list[Stage]:
        return [s for s in (service.stage, service.retiring) if s is not None]

    metrics = service.metrics
    metrics.watch(
        "active_sessions", "Sessions (KV caches) open on this node",
        lambda: sum(len(s.sessions) for s in stages()),
    )  # fmt: skip
    metrics.watch(
        "kv_tokens", "Tokens held in this node's KV caches",
        lambda: sum(s.sessions.tokens_held for s in stages()),
    )  # fmt: skip
    metrics.watch(
        "kv_budget_tokens", "The most KV tokens this node holds (--kv-budget-tokens)",
        lambda: service.stage.sessions.kv_budget_tokens,
    )  # fmt: skip
    metrics.watch(
        "tokens_served", "Tokens generated through this node's stage (sampled steps run)",
        lambda: service.tokens_served, kind="counter",
    )  # fmt: skip
    metrics.watch(
        "decode_batches", "Decode passes that merged steps of several sessions",
        lambda: service.scheduler.queue.batches, kind="counter",
    )  # fmt: skip
    metrics.watch(
        "quarantined", "1 while the tracker quarantines this node (docs/adr/0026)",
        lambda: int(service.quarantined is not None),
    )  # fmt: skip
    metrics.watch(
        "shard_layers", "Layers this node serves, by model",
        lambda: [({"model": service.model_id}, len(service.stage.shard.layers))],
    )  # fmt: skip
    watch_prefix_cache(metrics, stages)


def watch_prefix_cache(metrics, stages) -> None:
    """The prefix cache's use (docs/adr/0035), summed over the live stages."""

    def caches():
        return [s.sessions.prefix for s in stages() if s.sessions.prefix is not None]

    def stat(name: str):
        return lambda: sum(getattr(c.stats, name) for c in caches())

    for name, what in (
        ("lookups", "Sessions that asked for cached prompt blocks"),
        ("hits", "Sessions that started after cached prompt blocks"),
        ("tokens_saved", "Prompt positions not computed: they came from the prefix cache"),
        ("evicted", "Cached prefixes dropped to make room"),
    ):
        metrics.watch(f"prefix_cache_{name}", what, stat(name), kind="counter")
    metrics.watch(
        "prefix_cache_blocks", "128-token blocks held in the prefix cache (in the KV budget)",
        lambda: sum(c.blocks for c in caches()),
    )  # fmt: skip
