"""Prometheus metrics of one service (tracker or node), all named ``meshnet_*``.

Every service owns a ``Metrics`` with its own ``CollectorRegistry``: several services can
share a process (the tracker node; in-process tests) without their numbers mixing. Values
that already live elsewhere (sessions, KV tokens, the coverage map) are read at scrape time
through callbacks instead of being copied on every change.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# The ``*_created`` timestamp series double the output and no dashboard reads them.
disable_created_metrics()

PREFIX = "meshnet_"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds: one CPU decode step of a tiny model is ~1 ms, a 70B prefill chunk can take ~10 s.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

# A callback returns one value, or (labels, value) pairs for a labelled metric.
Sample = float | Iterable[tuple[dict[str, str], float]]


class CallbackCollector(Collector):
    """A gauge or counter whose value is read from ``fn`` at every scrape."""

    def __init__(
        self, name: str, documentation: str, fn: Callable[[], Sample], kind: str = "gauge"
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.fn = fn
        self.kind = kind

    def collect(self):
        value = self.fn()
        family_type = GaugeMetricFamily if self.kind == "gauge" else CounterMetricFamily
        if isinstance(value, int | float):
            yield family_type(self.name, self.documentation, value=float(value))
            return
        samples = list(value)
        label_names = sorted({key for labels, _ in samples for key in labels})
        family = family_type(self.name, self.documentation, labels=label_names)
        for labels, sample in samples:
            family.add_metric([labels.get(key, "") for key in label_names], float(sample))
        yield family


class Metrics:
    """The metrics one service exposes on ``GET /metrics``.

    Counters count from process start; histograms are in seconds. A node fills the data-path
    metrics, a tracker the request metrics and (through callbacks) the swarm gauges; the
    tracker node fills both into one registry.
    """

    def __init__(self, version: str | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        for standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(standard)  # process_*, python_info, python_gc_* as in any exporter
        build = Gauge("meshnet_build_info", "meshnet's version (value 1)", ["version"], registry=r)
        build.labels(version or _version()).set(1)
        # Request scheduling at a head, named as vLLM names them (vllm:num_requests_running...)
        self.requests_running = Gauge(
            "meshnet_num_requests_running", "Generations this head is running", registry=r
        )
        self.requests_waiting = Gauge(
            "meshnet_num_requests_waiting", "Requests waiting for room in the chain", registry=r
        )
        self.queue_seconds = Histogram(
            "meshnet_request_queue_time_seconds", "Time a request waited for room",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft_seconds = Histogram(
            "meshnet_time_to_first_token_seconds",
            "From the request reaching the head to its first token (queue time included)",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl_seconds = Histogram(
            "meshnet_inter_token_latency_seconds", "Time between a generation's tokens",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "meshnet_requests", "HTTP requests answered, by route and status",
            ["path", "status"], registry=r,
        )  # fmt: skip
        self.request_seconds = Histogram(
            "meshnet_request_seconds", "HTTP request duration, by route (streams: until the end)",
            ["path"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.errors = Counter(
            "meshnet_errors", "Errors answered (or sent in-band on a stream), by status and code",
            ["status", "code"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "meshnet_prompt_tokens", "Prompt tokens prefilled by generations this head drove",
            registry=r,
        )  # fmt: skip
        self.tokens_generated = Counter(
            "meshnet_tokens_generated", "Tokens generated for clients by this head", registry=r
        )
        self.prefill_seconds = Histogram(
            "meshnet_prefill_seconds",
            "Prefill of one generation through the whole chain, up to its first token",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.decode_seconds = Histogram(
            "meshnet_decode_step_seconds", "One decode step through the whole chain",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.direct_answers = Counter(
            "meshnet_direct_answers",
            "Steps whose answer came straight from the tail: before the chain's (ADR-0020), or "
            "on the head's answer lane instead of it (ADR-0060)", registry=r,
        )  # fmt: skip
        self.lane_steps = Counter(
            "meshnet_lane_steps",
            "Decode steps run here from a decode lane (docs/adr/0058)", registry=r,
        )  # fmt: skip
        self.lane_ahead_steps = Counter(
            "meshnet_lane_ahead_steps",
            "Decode steps a head ran ahead down its decode lane, after the one it was given "
            "(docs/adr/0059)", registry=r,
        )  # fmt: skip
        self.lane_refused = Counter(
            "meshnet_lane_refused",
            "Steps a decode lane refused before they ran: their sender used the hop stream",
            registry=r,
        )  # fmt: skip
        self.draft_tokens = Counter(
            "meshnet_spec_decode_num_draft_tokens",
            "Draft tokens decode steps carried for the chain to verify", registry=r,
        )  # fmt: skip
        self.accepted_tokens = Counter(
            "meshnet_spec_decode_num_accepted_tokens",
            "Draft tokens the tail kept (acceptance rate: this over the drafts)", registry=r,
        )  # fmt: skip
        self.tokens_per_step = Histogram(
            "meshnet_tokens_per_traversal",
            "Tokens one decode step's traversal of the chain produced (drafts kept + 1)",
            buckets=(1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 33), registry=r,
        )  # fmt: skip
        self.hop_seconds = Histogram(
            "meshnet_hop_seconds",
            "One forward frame sent to the next hop until its answer (includes later hops)",
            ["hop"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.wire_sent = Counter(
            "meshnet_wire_sent_bytes",
            "Step bytes sent to next hops (the step and its activation frame)",
            registry=r,
        )
        self.wire_received = Counter(
            "meshnet_wire_received_bytes", "Step bytes received from previous hops (step and frame)",
            registry=r,
        )  # fmt: skip
        self.failovers = Counter(
            "meshnet_failovers", "Hop failures this head routed around", registry=r
        )
        self.replay_seconds = Histogram(
            "meshnet_replay_seconds", "Time a failover's replay took to rebuild a fresh "
            "chain's caches (the prompt, then every decode pass so far)",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r,
        )  # fmt: skip
        self.audits = Counter(
            "meshnet_audits", "Verification audits this node ran (docs/adr/0026, 0032), by outcome: "
            "agreed, convicted (a node computed wrong), disputed (two replicas disagree and "
            "nothing tells which is right), skipped (no replica to compare with, or the "
            "session ended first)", ["outcome"], registry=r,
        )  # fmt: skip
        self.audit_error = Histogram(
            "meshnet_audit_error", "Relative L2 distance between a hop's output row and a "
            "replica's recomputation of it, per audit",
            buckets=(1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.5, 1.0), registry=r,
        )  # fmt: skip
        self.shard_fetches = Counter(
            "meshnet_shard_fetches", "Shards this node fetched, by result (ok, cached, failed)",
            ["result"], registry=r,
        )  # fmt: skip
        self.fetched_bytes = Counter(
            "meshnet_shard_fetched_bytes", "Verified shard bytes this node fetched", registry=r
        )

    def watch_queue(self, waiting: Callable[[], int]) -> None:
        self.requests_waiting.set_function(waiting)

    def watch(
        self, name: str, documentation: str, fn: Callable[[], Sample], kind: str = "gauge"
    ) -> None:
        """Expose a value read from ``fn`` at scrape time (``name`` without the prefix)."""
        self.registry.register(CallbackCollector(PREFIX + name, documentation, fn, kind))

    def error(self, status: int, code: str | None) -> None:
        self.errors.labels(str(status), code or "none").inc()

    @contextmanager
    def timer(self, histogram: Histogram, *labels: str):
        """Observe the wall time of the ``with`` body (async bodies included)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            target = histogram.labels(*labels) if labels else histogram
            target.observe(time.perf_counter() - started)

    def exposition(self) -> bytes:
        """The Prometheus text format of everything in this registry."""
        return _generate_latest(self.registry)


def _version() -> str:
    import importlib.metadata

    for dist in ("meshnet-node", "meshnet-tracker", "meshnet-common"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"
