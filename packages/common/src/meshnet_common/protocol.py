"""Internal messages between tracker and nodes: strict pydantic models (unknown fields are
an error), frozen except ``StepResult`` (the head adds the hops' compute times to it);
registrations carry a protocol ``version``.

Layer ranges travel as ``shard_start`` / ``shard_end`` (half-open, see ``LayerRange``).
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from meshnet_common.config import defaults
from meshnet_common.errors import InvalidRequest
from meshnet_common.layers import LayerRange
from meshnet_common.models.models_dir import validate_model_id
from meshnet_common.precision import Precision, compute_dtype_name

PROTOCOL_VERSION = 1

NodeId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]


def _model_id(value: str) -> str:
    try:
        validate_model_id(value)  # the one rule, shared with the models dir
    except InvalidRequest as exc:
        raise ValueError(exc.message) from exc
    return value


ModelId = Annotated[str, Field(min_length=3, max_length=200), AfterValidator(_model_id)]
# A name clients may use for a model (--served-model-name): free-form, as in vLLM.
PublicKey = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{43}$")]  # a node's Ed25519 key
ServedName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[\w.:/@+-]+$")]
# scheme://host[:port][/] and nothing else: no path, query, fragment or user info (a URL the
# tracker calls back must name an address, not smuggle a request; docs/adr/0032)
Url = Annotated[
    str,
    Field(
        min_length=8, max_length=300,
        pattern=r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)(:\d{1,5})?/?$",
    ),
]  # fmt: skip
# --quantization, --dtype and --quant-group-size as they travel (meshnet_common.precision).
Quantization = Literal["auto", "bfloat16", "float32", "int8", "int4", "nf4", "fp8", "mxfp4"]
ComputeDtype = Literal["bfloat16", "float32"]
RequestedDtype = Literal["auto", "bfloat16", "float32"]  # --dtype as asked (auto: ADR-0046)
GroupSize = Literal[32, 64, 128]
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def validate_session_id(value: str | None, *, param: str = "session_id") -> str:
    """A session id is a URL-safe token (the head makes uuid4 hex): no dots, no slashes."""
    if not value or not SESSION_ID.fullmatch(value):
        raise InvalidRequest(
            f"invalid session id {str(value)[:40]!r}: expected 1-128 of [A-Za-z0-9_-]",
            param=param,
        )
    return value


# HTTP headers of a forward step (the body is one tensor frame, see meshnet_common.wire).
H_SESSION = "x-meshnet-session"
H_SESSION_KEY = "x-meshnet-session-key"  # binds a session to the chain that opened it
H_POSITION = "x-meshnet-position"
H_CHUNK = "x-meshnet-chunk"
H_ROUTE = "x-meshnet-route"  # comma-separated URLs of the hops after this one
H_OPEN = "x-meshnet-open"  # JSON OpenSpec: open the session on every hop first
H_SAMPLE = "x-meshnet-sample"  # "1": the tail samples this step's last token
# The step's token ids, comma-separated: heads always send them (the tail's penalties count
# them, the hop after a head audits it with them: docs/adr/0032).
H_IDS = "x-meshnet-ids"
# How many of the step's last tokens are drafts for the tail to verify (speculative
# decoding, ADR-0019); such a step always carries its ids.
H_DRAFTS = "x-meshnet-drafts"
# A guess step (ADR-0019): its one token is the head's guess of the token the tail has not
# answered yet, sent before that answer. The value is the first position a later step may
# go back to (the head's first guess still unanswered); a tail that did not sample this
# token there answers ``stale`` without computing.
H_GUESS = "x-meshnet-guess"
# The head's base URL: the tail also posts the step's answer straight there
# (``POST /v1/answers/{session}``), one link instead of the chain back (ADR-0020).
H_ANSWER_TO = "x-meshnet-answer-to"
# A failover's replay streams its decode passes down the chain without waiting for their
# answers (docs/adr/0023): pass n carries n, and a hop runs it once it ran pass n - 1.
H_REPLAY_PASS = "x-meshnet-replay-pass"
H_SWARM_TOKEN = "x-meshnet-swarm-token"
# A node's proof of its id on its calls to the tracker after registering (docs/adr/0032):
# the secret the tracker issued in its RegisterResponse.
H_NODE_SECRET = "x-meshnet-node-secret"
# The operator's credential (--operator-token) for removing another node or lifting a
# quarantine (docs/adr/0032); distinct from the swarm token every node holds.
H_OPERATOR_TOKEN = "x-meshnet-operator-token"
# The tracker proxying a request to a head names the client's address, so that the head's
# wait queue takes turns by client (docs/adr/0032); believed only beside the swarm token.
H_CLIENT_ADDRESS = "x-meshnet-client-address"
# ... and the client's tenant (``web.auth.key_tenant``: a digest of its API key, never the
# key), so that a head keeps each key's cached prompts apart (docs/adr/0035); believed only
# beside the swarm token.
H_CLIENT_TENANT = "x-meshnet-client-tenant"
# On a step's answer: model compute of each hop from this one to the tail, in ms, comma-
# separated. Each hop prepends its own to what the next one answered and relays the tail's
# body untouched, so that no hop parses and re-serializes the answer (docs/adr/0011).
# On a step going down the chain with H_ANSWER_TO: the compute of the hops before this
# one (after the head), so that the tail's direct answer carries every hop's.
H_COMPUTE = "x-meshnet-compute-ms"
# Verification (docs/adr/0026): the global layer an audited session (or a recomputation)
# enters the node's shard at.
H_START_LAYER = "x-meshnet-start-layer"
MAX_HOPS = 64
MAX_PROBES = 16  # next hops a node times the links to (docs/adr/0021)
# A head's heartbeat reports the measured decode steps of at most this many routes, each of
# at most this many hops after it (docs/adr/0032).
MAX_ROUTE_TIMES = 16
MAX_ROUTE_TIME_HOPS = 16
# The most memory a node may claim (32 TiB): more would only attract placement and prompts
# to a node that lies about it (docs/adr/0032).
MAX_MEMORY_BYTES = 1 << 45


def format_compute(own_ms: float, downstream: str | None = None) -> str:
    """This hop's compute time, then the hops after it (dropped past MAX_HOPS entries)."""
    own = f"{own_ms:.3f}"
    if not downstream or downstream.count(",") >= MAX_HOPS - 1:
        return own
    return f"{own},{downstream}"


def append_compute(upstream: str | None, own_ms: float) -> str:
    """The hops before this one (going down the chain), then this hop's compute time."""
    own = f"{own_ms:.3f}"
    if not upstream or upstream.count(",") >= MAX_HOPS - 1:
        return own
    return f"{upstream},{own}"


def parse_compute(raw: str | None) -> list[float]:
    """The compute times of an answer's hops; an absent or malformed header gives []."""
    if not raw:
        return []
    try:
        values = [float(part) for part in raw.split(",", MAX_HOPS)[:MAX_HOPS]]
    except ValueError:
        return []
    return [v for v in values if 0.0 <= v < 1e9]


class Strict(BaseModel):
    """Base of internal messages: unknown fields are an error, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeState(StrEnum):
    JOINING = "joining"
    SERVING = "serving"
    LEAVING = "leaving"


class ShardSpec(Strict):
    """A model and a half-open layer range of it."""

    model_id: ModelId
    shard_start: int = Field(ge=0)
    shard_end: int = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> ShardSpec:
        if self.shard_end <= self.shard_start:
            raise ValueError("shard_end must be greater than shard_start")
        return self

    @property
    def layers(self) -> LayerRange:
        return LayerRange(self.shard_start, self.shard_end)


class NodeAnnouncement(Strict):
    """What a node tells the tracker about itself when it registers."""

    version: Literal[1] = PROTOCOL_VERSION
    node_id: NodeId
    url: Url
    shard: ShardSpec
    num_layers: int = Field(gt=0)
    # The precision the node holds its weights in (resolved: never auto), its compute dtype
    # (--dtype; float32 for a float32 shard), and for int4 the quantization group size.
    quantization: Precision
    dtype: ComputeDtype = "bfloat16"
    quant_group_size: GroupSize | None = None
    device: str = Field(max_length=32)
    memory_declared_bytes: int = Field(ge=0, le=MAX_MEMORY_BYTES)
    memory_free_bytes: int = Field(ge=0, le=MAX_MEMORY_BYTES)
    kv_budget_tokens: int = Field(gt=0, default=defaults.KV_BUDGET_TOKENS)
    # JOINING: announced when loading starts (placement counts it as pending capacity, routing
    # ignores it); SERVING once the node listens and its layers are loaded.
    state: NodeState = NodeState.SERVING
    # True: the operator gave ``url`` (--advertise-url) and the tracker uses it as given.
    # False: ``url`` is the bind address; the tracker replaces a wildcard host, or a loopback
    # one when the node connects from another host, with the address it sees the node at.
    url_explicit: bool = False
    # Whether the tracker may move this node to another range: a node the tracker placed, or
    # one started with --allow-rebalance. A range given by hand is the operator's decision.
    movable: bool = False
    # The model card a head answers /v1/models with (the tracker lists the same): the names
    # clients may use (--served-model-name; empty: the model id), the longest prompt +
    # completion accepted (--max-model-len), when the snapshot was written (Unix time).
    served_names: tuple[ServedName, ...] = Field(default=(), max_length=16)
    max_model_len: int | None = Field(default=None, gt=0)
    created: int = Field(default=0, ge=0)
    # The node's Ed25519 public key (URL-safe base64 of its 32 bytes): the tracker certifies
    # it, and the node signs its calls to peers with it (docs/adr/0032).
    public_key: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{43}$")

    @property
    def compute_dtype(self) -> str:
        """The dtype it computes in: float32 for a float32 shard whatever ``dtype`` says
        (an older node announces no dtype)."""
        return compute_dtype_name(self.quantization, self.dtype)


class RegisterResponse(Strict):
    node_id: NodeId
    heartbeat_interval_s: float
    url: Url | None = None  # where the tracker (and the swarm) will reach this node
    # The node's proof of its id (docs/adr/0032): sent in ``x-meshnet-node-secret`` on every
    # later call (re-register, heartbeat, leave, verdicts). Issued at the first registration
    # of the id, the same one while the record lives.
    node_secret: str | None = Field(default=None, max_length=128)
    # The tracker's certificate of the node's public key, and the tracker's key that checks
    # it (and peers' certificates): docs/adr/0032. None when no key was announced.
    certificate: str | None = Field(default=None, max_length=512)
    tracker_key: str | None = Field(default=None, max_length=64)


class RouteTime(Strict):
    """What a head measured of a route it used: the median wall time of its last plain
    decode steps (one token, no drafts, no failover), its own compute included. The tracker
    holds it against the compute the route's nodes claim (docs/adr/0032)."""

    hops: tuple[Url, ...] = Field(min_length=1, max_length=MAX_ROUTE_TIME_HOPS)  # after it
    step_ms: float = Field(gt=0, le=60_000)


class Heartbeat(Strict):
    """Periodic liveness and load report."""

    node_id: NodeId
    state: NodeState
    active_sessions: int = Field(ge=0)
    kv_tokens: int = Field(ge=0)
    memory_free_bytes: int = Field(ge=0, le=MAX_MEMORY_BYTES)
    tokens_generated: int = Field(ge=0, default=0)  # sampled here (the tail)
    # Sampled steps this node ran since it started: tokens generated through its stage
    # (the tracker turns the difference between heartbeats into tokens/s).
    tokens_served: int = Field(ge=0, default=0)
    # For routes by expected step time (docs/adr/0021): decode compute per layer, and the
    # round trip to each next hop the tracker asked this node to probe (URL -> ms).
    layer_ms: float | None = Field(default=None, ge=0, le=1e6)
    links: dict[Url, Annotated[float, Field(ge=0, le=1e6)]] = Field(
        default_factory=dict, max_length=MAX_PROBES
    )
    # A head's measured decode steps per route it used lately (docs/adr/0032).
    route_times: tuple[RouteTime, ...] = Field(default=(), max_length=MAX_ROUTE_TIMES)
    # The prefix cache (docs/adr/0035): blocks held, and sessions that asked for cached
    # blocks and that got them, since the node started.
    prefix_blocks: int = Field(ge=0, default=0)
    prefix_lookups: int = Field(ge=0, default=0)
    prefix_hits: int = Field(ge=0, default=0)


class DirectiveKind(StrEnum):
    LOAD_SHARD = "LOAD_SHARD"
    DROP_SHARD = "DROP_SHARD"


class Directive(Strict):
    """A rebalance directive carried in a heartbeat reply."""

    kind: DirectiveKind
    shard: ShardSpec


class HeartbeatResponse(Strict):
    known: bool  # False: the tracker lost this node (e.g. it restarted) — register again
    directives: tuple[Directive, ...] = ()
    probe: tuple[Url, ...] = Field(default=(), max_length=MAX_PROBES)  # next hops to time
    # Why the tracker quarantined this node (docs/adr/0026); None: it is not.
    quarantined: str | None = Field(default=None, max_length=300)
    certificate: str | None = Field(default=None, max_length=512)  # renewed (docs/adr/0032)
    # Node keys whose certificates the tracker revoked (removed or quarantined nodes):
    # peers refuse their calls from now on (``meshnet_common.trust.revocation``).
    revoked: tuple[PublicKey, ...] = Field(default=(), max_length=1024)


class SignedRow(Strict):
    """One node's output row for an audit's inputs, signed with its node secret
    (``meshnet_common.trust.evidence``)."""

    node_id: NodeId
    row: str = Field(max_length=1 << 20)  # base64 of the row's float32 values
    signature: str = Field(pattern=r"^[0-9a-f]{64}$")


class Evidence(Strict):
    """What a verdict shows (docs/adr/0032): rows signed by the suspect (one, or two answers
    to the same inputs) and by witnesses, all computed from the inputs frame of this digest,
    entering at ``start_layer``."""

    inputs_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    start_layer: int = Field(ge=0)
    suspect_rows: tuple[SignedRow, ...] = Field(min_length=1, max_length=2)
    witness_rows: tuple[SignedRow, ...] = Field(default=(), max_length=8)


class Verdict(Strict):
    """A head's finding that a node computed wrong (docs/adr/0026): its output for a
    session's last row lay ``error`` (relative L2) from what ``witnesses`` computed from
    the same input, more than ``tolerance`` allows, while the witnesses agreed."""

    model_id: ModelId
    reporter: NodeId  # the head that ran the check
    shard_start: int = Field(ge=0)  # the layers compared: where the session entered the node
    shard_end: int = Field(gt=0)
    error: float = Field(ge=0)
    tolerance: float = Field(gt=0)
    witnesses: tuple[NodeId, ...] = Field(min_length=1, max_length=8)
    evidence: Evidence | None = None  # required from a remote reporter (docs/adr/0032)


class VerdictResponse(Strict):
    strikes: int  # verdicts against the node so far
    quarantined: bool


class RouteHop(Strict):
    node_id: NodeId
    url: Url
    shard_start: int
    shard_end: int


class RouteResponse(Strict):
    model_id: ModelId
    hops: tuple[RouteHop, ...]


TEMPERATURE_MAX = 2.0  # the OpenAI API's bound
TOP_LOGPROBS_MAX = 20
PENALTY_MAX = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI)
REPETITION_PENALTY_MAX = 10.0
LOGIT_BIAS_MAX_ENTRIES = 300  # OpenAI's limit
LOGIT_BIAS_MAX = 100.0
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


GRAMMAR_MAX_BYTES = 32 * 1024  # a JSON schema travels in the open header


class GrammarSpec(Strict):
    """A constraint on what the tail may sample: an llguidance grammar (its JSON form, e.g.
    built from a JSON schema), checked at the head before any session opens."""

    kind: Literal["json_object", "json_schema"]
    grammar: str = Field(min_length=2, max_length=GRAMMAR_MAX_BYTES)


class SamplingSpec(Strict):
    """How the tail picks the next token — the one sampling type, with one set of bounds:
    the OpenAI request builds it, the open header carries it to every hop as it is, and the
    tail's sampler reads it. ``temperature`` 0 is greedy; ``top_k`` 0 means no limit."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int = 0  # how many top alternatives to report (0 = none)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's: over prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    # Tokens of the original prompt: the tail counts the rest of the history (which each
    # step's ids header brings, replays included) as output for the penalties.
    prompt_tokens: int = Field(default=0, ge=0)
    grammar: GrammarSpec | None = None  # structured output: the tail masks what breaks it
    # Score the prompt too (``echo`` with ``logprobs``): the log-probability of each prompt
    # token after the ones before it, with this many top alternatives.
    prompt_logprobs: int | None = None

    @property
    def penalized(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def score_end(self) -> int | None:
        """Where a scored prompt's first call ends (ADR-0053): its rows before the last,
        whose distributions score it, are one call, as a scorer's forward of all tokens but
        the last computes them (lm-evaluation-harness's HF backend); None: not scored."""
        scored = self.prompt_logprobs is not None and self.prompt_tokens > 1
        return self.prompt_tokens - 1 if scored else None

    @property
    def needs_history(self) -> bool:
        """Whether the tail must see the token ids (penalties count them; a grammar is
        advanced by them, replays included; prompt log-probabilities score them)."""
        return self.penalized or self.grammar is not None or self.prompt_logprobs is not None

    @model_validator(mode="after")
    def _bounded(self) -> SamplingSpec:
        biases = self.logit_bias
        checks = (
            ("temperature", math.isfinite(self.temperature)
             and 0.0 <= self.temperature <= TEMPERATURE_MAX),
            ("top_p", math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0),
            ("top_k", self.top_k >= 0),
            ("min_p", math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0),
            ("logprobs", 0 <= self.logprobs <= TOP_LOGPROBS_MAX),
            ("prompt_logprobs", self.prompt_logprobs is None
             or 0 <= self.prompt_logprobs <= TOP_LOGPROBS_MAX),
            ("seed", self.seed is None or SEED_MIN <= self.seed <= SEED_MAX),
            ("presence_penalty", math.isfinite(self.presence_penalty)
             and abs(self.presence_penalty) <= PENALTY_MAX),
            ("frequency_penalty", math.isfinite(self.frequency_penalty)
             and abs(self.frequency_penalty) <= PENALTY_MAX),
            ("repetition_penalty", math.isfinite(self.repetition_penalty)
             and 0.0 < self.repetition_penalty <= REPETITION_PENALTY_MAX),
            ("logit_bias", len(biases) <= LOGIT_BIAS_MAX_ENTRIES and all(
                t >= 0 and math.isfinite(b) and abs(b) <= LOGIT_BIAS_MAX for t, b in biases)),
        )  # fmt: skip
        for param, ok in checks:
            if not ok:  # not a ValueError: pydantic lets it through, param and all
                raise InvalidRequest(f"invalid {param}: {getattr(self, param)!r}", param=param)
        return self


class StepResult(BaseModel):
    """The tail's answer to a sampled step, relayed back along the chain to the head."""

    model_config = ConfigDict(extra="forbid")

    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = Field(default_factory=list)
    # With the first token of a session that scores its prompt: for each prompt token after
    # the first, its log-probability and the top alternatives (``SamplingSpec.prompt_logprobs``)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # A step with drafts: the tokens after ``token_id`` (the drafts the tail kept, then its
    # own), each as (token id, log-probability, top alternatives)
    more: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    # Model compute of each hop for this step, in route order (ms): the head subtracts it
    # from the step's wall time to see what serving and the network cost per hop. On the
    # wire it travels in the H_COMPUTE header, not in the body.
    compute_ms: list[float] = Field(default_factory=list, max_length=MAX_HOPS)
    # True: a guess step whose guess was wrong (ADR-0019); the tail computed nothing
    stale: bool | None = None


class AssignRequest(Strict):
    """A node with no model asks the tracker where it should serve."""

    node_id: NodeId
    memory_bytes: int = Field(gt=0, le=MAX_MEMORY_BYTES)
    device: str = Field(max_length=32)
    # What the node asks for: auto (each model's shipped format, else the compute dtype) or
    # a precision; the tracker resolves it per candidate model.
    quantization: Quantization = "bfloat16"
    dtype: RequestedDtype = "auto"
    quant_group_size: GroupSize = 64
    kv_tokens: int = Field(gt=0, le=1 << 24)
    held_models: tuple[ModelId, ...] = ()


class AssignResponse(Strict):
    """The tracker's answer: a shard, and where its weights can be had."""

    shard: ShardSpec
    num_layers: int
    reason: str
    sources: tuple[Url, ...] = ()
    memory_bytes: int = Field(ge=0, default=0)  # what the shard needs (weights + KV budget)
    quantization: Precision | None = None  # the node's request resolved for this model
    dtype: ComputeDtype | None = None  # and its compute dtype (auto resolved: ADR-0046)
