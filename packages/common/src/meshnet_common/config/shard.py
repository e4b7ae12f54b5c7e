"""The settings of a process that serves layers (meshnet-node, and the tracker node) and
the checks on them that need no model: pydantic only, so ``--help`` stays fast and the
tracker can offer these knobs without the node package."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, ClassVar
from urllib.parse import urlsplit

from pydantic import field_validator, model_validator
from pydantic_settings import NoDecode

from meshnet_common.config import defaults, listening
from meshnet_common.config.settings import knob
from meshnet_common.layers import LayerRange
from meshnet_common.logs import FORMATS, LEVELS
from meshnet_common.openai_protocol import MAX_CHOICES, MAX_PROMPTS, MAX_STOP_CHARS
from meshnet_common.precision import (
    DEFAULT_GROUP_SIZE,
    DTYPE_CHOICES,
    GROUP_SIZES,
    QUANTIZATION_CHOICES,
    Precision,
    compute_dtype_name,
    resolve_precision,
)
from meshnet_common.protocol import GRAMMAR_MAX_BYTES
from meshnet_common.web.hosts import is_loopback

MODEL = "model and layer range"
DATA = "data path"
SECURITY = "security"
LOGGING = "logging"


class ShardSettings(listening.ListenSettings):
    """Knobs every layer-serving process has: the shard, its compute, the data path,
    secrets and logging. Subclasses add their own (the node's swarm and weights, the
    tracker's map)."""

    GROUPS: ClassVar[dict[str, str | None]] = {
        MODEL: "Give all of --model-id, --shard-start and --shard-end, or none of them: then "
        "the tracker assigns a shard (coverage first) and the weights are fetched if needed.",
        DATA: None,
        SECURITY: "Prefer the env vars for secrets: process arguments are visible to others.",
        LOGGING: None,
    }

    # -- model and layer range --
    model_id: str | None = knob(None, "model id ORG/NAME", group=MODEL)
    shard_start: int | None = knob(None, "first layer served (inclusive)", group=MODEL)
    shard_end: int | None = knob(None, "end of the layer range (exclusive)", group=MODEL)
    quantization: str = knob(
        "auto", "how weights are held: auto (a checkpoint's shipped fp8/mxfp4 stays packed, "
        "else plain weights at --dtype), bfloat16 (plain weights at --dtype; fp8/mxfp4 "
        "checkpoints dequantized), float32 (weights and compute in float32: exactness checks "
        "on CPU), int8 (per-output-channel int8, ~1/2 of bfloat16), int4 (group-wise int4, "
        "~1/4; --quant-group-size), nf4 (bitsandbytes 4-bit; not for MoE), fp8 / mxfp4 (keep "
        "a checkpoint's shipped format packed; only for a checkpoint that ships it)",
        group=MODEL, choices=QUANTIZATION_CHOICES,
    )  # fmt: skip
    dtype: str = knob(
        "auto", "compute precision: activations, norms, embeddings and the KV cache "
        "(float32: twice the memory for those, exact against a float32 reference; auto: "
        "float32 for a GGUF, as llama.cpp computes it, else bfloat16)",
        group=MODEL, choices=DTYPE_CHOICES,
    )  # fmt: skip
    quant_group_size: int = knob(
        DEFAULT_GROUP_SIZE, "int4: weights of a row sharing one scale and zero (smaller: "
        "closer to the bfloat16 output, more memory for scales)", group=MODEL,
        choices=GROUP_SIZES,
    )  # fmt: skip
    memory_gb: float | None = knob(
        None, "memory this node offers, GiB (default: what is available on the host, less "
        "what other meshnet nodes there claimed; once the range is known, what it needs)",
        group=MODEL,
    )  # fmt: skip
    device: str = knob("auto", "auto, cpu or cuda", group=MODEL)
    threads: int | None = knob(None, "torch compute threads (default: torch's)", group=MODEL)
    bf16_kernel: bool = knob(
        True, "on an x86 CPU with AVX2 but no bfloat16 arithmetic, multiply bf16 linears "
        "several rows at a time with a kernel that sums exactly as torch does there (same "
        "numbers, 2-5x faster for batched steps and prompts; built once with g++, checked "
        "against torch before use, ADR-0030)", group=MODEL, action="bool",
    )  # fmt: skip
    engine: str = knob(
        "native", "native: packed low-bit Llama/Mistral/Qwen2 stages in C++ with own attention "
        "(ADR-0044), others as program: decode steps with transformers' numbers (ADR-0041)",
        group=MODEL, choices=("native", "program", "modules"),
    )  # fmt: skip
    cuda_graphs: bool = knob(True, "on CUDA, replay a session's one-token decode steps from "
                             "a captured CUDA graph (ADR-0056)", group=MODEL, action="bool")  # fmt: skip
    widen_bf16: bool = knob(
        False, "on a CPU without bfloat16 arithmetic (no AVX-512), multiply calls of many rows "
        "(prompts, batched steps, drafts) in float32 on the bf16 weights: 2-4.6x faster there, "
        "but rounding then depends on how many rows share a call, so in a rare near-tie the "
        "output can differ from the unsplit model's (ADR-0027)", group=MODEL, action="bool",
    )  # fmt: skip
    kv_budget_tokens: int = knob(
        defaults.KV_BUDGET_TOKENS, "most tokens held in KV caches across sessions (beyond: 503)",
        group=MODEL,
    )  # fmt: skip
    max_sessions: int = knob(256, "most sessions open at once (beyond: 503)", group=MODEL)
    prefix_cache: bool = knob(
        False, "keep finished sessions' prompts in 128-token blocks in the KV budget, so that a "
        "prompt starting with them (the next turn of a chat, a shared system prompt) skips "
        "their computation on every hop: faster, but past those blocks the output is no longer "
        "the unsplit model's bits, which compute the whole prompt in one call (docs/adr/0035, "
        "ADR-0054)", group=MODEL, action="bool",
    )  # fmt: skip
    max_model_len: int | None = knob(
        None, "longest prompt + completion a request may use; longer ones are refused up front "
        "with context_length_exceeded (default: the model's context, at most the KV budget)",
        group=MODEL,
    )  # fmt: skip
    max_queued_requests: int = knob(
        64, "requests a head lets wait for room when the chain is full (a KV budget or session "
        "limit); beyond: 503 with Retry-After", group=MODEL,
    )  # fmt: skip
    queue_timeout_s: float = knob(
        30.0, "seconds a request may wait for room before a 503 with Retry-After",
        group=MODEL, flag="--queue-timeout",
    )  # fmt: skip
    coverage_wait_s: float = knob(
        30.0, "seconds a request waits for missing layers to come back when they are expected "
        "to (a node of that range loading or restarting); with no prospect it fails at once "
        "(0: never wait)", group=MODEL, flag="--coverage-wait",
    )  # fmt: skip
    verify_fraction: float = knob(
        0.0, "the fraction of decode steps after which a computation is audited: on a head, "
        "one hop of the chain; on the hop after a head, that head (of the sessions it "
        "chooses with this probability). A replica of the layers recomputes the output from "
        "the same input, and a node that disagrees (by more than the precision allows) is "
        "reported to the tracker, which quarantines it, and failed over (0: never; each "
        "audit costs a replica a prefill of the session so far)", group=MODEL,
    )  # fmt: skip
    reasoning_parser: str | None = knob(
        None, "return <think>...</think> text as reasoning_content apart from content: "
        "deepseek_r1 (reasoning until </think>) or qwen3 (only after a leading <think>)",
        group=MODEL, choices=("deepseek_r1", "qwen3"),
    )  # fmt: skip
    tool_call_parser: str | None = knob(
        None, "the format the model writes tool calls in, as vLLM names it (openai: gpt-oss "
        "harmony; default: chosen from the chat template's markers)", group=MODEL,
        choices=("hermes", "llama3_json", "mistral", "openai", "deepseek_v3"),
    )  # fmt: skip
    served_model_name: Annotated[tuple[str, ...], NoDecode] = knob(
        (), "name clients may use for the model, listed by /v1/models (repeatable; env: "
        "comma-separated; default: --model-id)", group=MODEL, action="append",
    )  # fmt: skip
    session_idle_timeout_s: float = knob(
        300.0, "seconds a session may sit idle before its KV cache is freed",
        group=MODEL, flag="--session-idle-timeout",
    )  # fmt: skip

    speculative: str = knob(
        "greedy", "speculative decoding with drafts looked up in the text itself (n-gram): "
        "greedy (temperature 0 requests; the text is that of one-at-a-time decoding, in "
        "bfloat16 too), all (sampled ones too: the acceptance rule keeps their "
        "distribution), off; auto is the same as greedy. The head drafts only while it pays",
        group=MODEL, choices=("auto", "greedy", "all", "off"),
    )  # fmt: skip
    max_draft_tokens: int = knob(
        4, "most draft tokens a decode step carries for the chain to verify (the head "
        "picks fewer, or none, when the measured step times and acceptance say so)",
        group=MODEL,
    )  # fmt: skip
    draft_model: str | None = knob(
        None, "a small model sharing the tokenizer that proposes the drafts on the head, "
        "instead of the n-gram lookup: a snapshot folder, or a model id in --models-dir",
        group=MODEL,
    )  # fmt: skip
    guess_steps: int = knob(
        8, "over a chain, the most decode steps of one greedy generation in flight, as the "
        "measured links need (4 until timed): each after the first carries the head's n-gram "
        "guess of its input, and a wrong guess costs the hops a row they would have idled "
        "through (0 or 1: none; drafts are then verified in one pass per step)",
        group=MODEL,
    )  # fmt: skip
    speculative_max_running: int = knob(
        2, "no drafting while more generations than this run on the head (batched decode "
        "already shares each pass over the weights)", group=MODEL,
    )  # fmt: skip

    # -- data path --
    chunk_tokens: int = knob(defaults.CHUNK_TOKENS, "prefill chunk size, tokens", group=DATA)
    prompt_call_tokens: int = knob(
        defaults.PROMPT_CALL_TOKENS, "a prompt up to this many tokens is one call on every hop, "
        "as the unsplit model computes it (longer: calls of this many; ADR-0053)", group=DATA,
    )  # fmt: skip
    direct_answers: bool = knob(
        True, "a head asks the tail of a 2+ hop route to post each sampled token straight "
        "back to it (hops + 1 link delays per token instead of 2 x hops); the chain's own "
        "answer still comes, so a tail that cannot reach the head only loses the gain",
        group=DATA, action="bool",
    )  # fmt: skip
    direct_min_rtt_ms: float = knob(
        5.0, "ask for direct answers only while the round trip to the route's first hop is at "
        "least this many ms (or not measured yet): on a LAN the chain's answer is as fast and "
        "a direct one costs each step another message (0: always)", group=DATA,
        flag="--direct-min-rtt",
    )  # fmt: skip
    lane_spin_ms: float = knob(2.0, "a decode lane's reader looks for a lone session's next step without sleeping for at most this long around when it is due, where --threads leave a CPU free (no wake-up on the step's way; 0: asleep until it comes)", group=DATA)  # fmt: skip
    max_decode_batch: int = knob(
        32, "decode steps of concurrent sessions merged into one pass (1: no batching)",
        group=DATA,
    )  # fmt: skip
    turn_max_ms: float = knob(
        250.0, "passes known to take less than this take one of the host's compute turns "
        "(nodes on one host then compute one after another), longer ones compute without; "
        "also the longest a node waits for a turn", group=DATA,
    )  # fmt: skip
    # Tests only: a slow shard (every compute pass) and a slow load, as on a big model.
    step_delay_ms: float = knob(0.0, "", group=DATA, hidden=True)
    load_delay_ms: float = knob(0.0, "", group=DATA, hidden=True)
    test_only_perturb: float = knob(
        0.0, "TESTING ONLY, never in a real swarm: add noise of this many times each output "
        "row's RMS to everything this node computes, as faulty hardware would (what "
        "--verify-fraction must catch)", group=DATA,
    )  # fmt: skip
    zstd_level: int | None = knob(None, "zstd level on every link (0: off; default 1, none on links measured fast: ADR-0057)", group=DATA)  # fmt: skip
    connect_timeout: float = knob(5.0, "per-hop connect timeout, seconds", group=DATA)
    chunk_timeout: float = knob(120.0, "per-hop prefill chunk timeout, seconds", group=DATA)
    step_timeout: float = knob(60.0, "per-hop decode step timeout, seconds", group=DATA)
    turn_timeout_s: float = knob(
        defaults.TURN_TIMEOUT_S, "seconds a prefill chunk waits for an earlier chunk of its "
        "session", group=DATA, flag="--turn-timeout",
    )  # fmt: skip
    open_timeout_s: float = knob(
        defaults.OPEN_TIMEOUT_S, "seconds a chunk waits for its session to open (chunk 0 late)",
        group=DATA, flag="--open-timeout",
    )  # fmt: skip
    stream_ping_s: float = knob(
        defaults.STREAM_PING_S, "seconds between keepalive pings on a hop stream; a stream "
        "that does not answer one within as long is dead (0: no pings)", group=DATA,
        flag="--stream-ping",
    )  # fmt: skip
    max_frame_mb: float = knob(64.0, "largest activation frame accepted, MiB", group=DATA)
    drain_timeout_s: float = knob(
        60.0, "on SIGTERM or POST /v1/node/drain: seconds the node waits for its sessions to "
        "finish before it exits anyway (the rest fail over)", group=DATA, flag="--drain-timeout",
    )  # fmt: skip

    # -- security --
    swarm_token: str | None = knob(None, "shared secret required between tracker and nodes", group=SECURITY, secret=True)  # fmt: skip
    api_key: str | None = knob(
        None, "clients must send it as 'Authorization: Bearer KEY'", group=SECURITY, secret=True
    )
    api_key_file: Path | None = knob(
        None, "a file of API keys, one a line (blank lines and # comments skipped): clients "
        "may send any of them, as well as --api-key", group=SECURITY,
    )  # fmt: skip
    allowed_origins: Annotated[tuple[str, ...], NoDecode] = knob(
        (), "browser origins (scheme://host[:port]; *: any) whose pages may call the API, "
        "e.g. Open WebUI's (CORS; repeatable; env: comma-separated)", group=SECURITY,
        action="append",
    )  # fmt: skip
    insecure: bool = knob(
        False, "listen on an address other machines reach without --swarm-token: anyone who "
        "reaches it may join the swarm, register nodes and report verdicts (docs/adr/0032)",
        group=SECURITY, action="bool",
    )  # fmt: skip
    max_request_mb: float = knob(8.0, "largest OpenAI JSON body (413 above)", group=SECURITY)
    max_prompts: int = knob(
        MAX_PROMPTS, "on a head: most prompts one completions request may hold (beyond: 400 "
        "too_many_prompts)", group=SECURITY,
    )  # fmt: skip
    max_choices: int = knob(
        MAX_CHOICES, "on a head: most generations one request may start, its prompts x n "
        "(beyond: 400 too_many_generations)", group=SECURITY,
    )  # fmt: skip
    max_stop_chars: int = knob(
        MAX_STOP_CHARS, "on a head: longest stop string, characters (each is looked for at "
        "every step of every generation; beyond: 400)", group=SECURITY,
    )  # fmt: skip
    max_schema_chars: int = knob(
        GRAMMAR_MAX_BYTES, "on a head: largest JSON schema of response_format or a forced "
        f"tool call, and of its grammar, characters (at most {GRAMMAR_MAX_BYTES}: the grammar "
        "travels in a hop header; beyond: 400 schema_too_large)", group=SECURITY,
    )  # fmt: skip
    prepare_timeout_s: float = knob(
        10.0, "on a head: seconds planning one request (tokenizing its prompts, its chat "
        "template, compiling its JSON schema) may take (beyond: 400 request_too_complex)",
        group=SECURITY, flag="--prepare-timeout",
    )  # fmt: skip
    tls_cert: Path | None = knob(
        None, "serve https/wss with this certificate (PEM; with --tls-key)", group=SECURITY
    )
    tls_key: Path | None = knob(None, "the private key of --tls-cert (PEM)", group=SECURITY)
    tls_ca: Path | None = knob(
        None, "verify the swarm's https/wss peers against this CA bundle (PEM; default: the "
        "system's CAs)", group=SECURITY,
    )  # fmt: skip

    # -- logging --
    log_level: str = knob(
        "info", "least severe events logged (prompt text appears only at debug)",
        group=LOGGING, choices=LEVELS,
    )  # fmt: skip
    log_format: str = knob(
        "logfmt", "one line per event: key=value pairs, or one JSON object",
        group=LOGGING, choices=FORMATS,
    )  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _range(cls, values):
        """``layers=LayerRange(a, b)`` is short for ``shard_start=a, shard_end=b``."""
        if isinstance(values, dict) and isinstance(values.get("layers"), LayerRange):
            values = dict(values)
            layers = values.pop("layers")
            values.update(shard_start=layers.start, shard_end=layers.end)
        return values

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names(cls, value):
        names = value.split(",") if isinstance(value, str) else value
        names = tuple(v.strip() for v in names if v.strip())
        bad = [n for n in names if not re.fullmatch(r"[\w.:/@+-]{1,200}", n)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a usable model name")
        return names

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _origins(cls, value):
        origins = value.split(",") if isinstance(value, str) else value
        origins = tuple(o.strip().rstrip("/") for o in origins if o.strip())
        bad = [o for o in origins if o != "*" and not re.fullmatch(r"https?://[^/\s,]+", o)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not an origin: scheme://host[:port], or *")
        return origins

    @field_validator("verify_fraction")
    @classmethod
    def _fraction(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError("must lie in [0, 1]")
        return value

    @field_validator(
        "max_prompts", "max_choices", "max_stop_chars", "prepare_timeout_s", "prompt_call_tokens"
    )
    @classmethod
    def _positive(cls, value):
        if not value > 0:
            raise ValueError("must be > 0")
        return value

    @field_validator("max_schema_chars")
    @classmethod
    def _schema_chars(cls, value: int) -> int:
        if not 2 <= value <= GRAMMAR_MAX_BYTES:  # the shortest grammar has 2
            raise ValueError(f"expected 2..{GRAMMAR_MAX_BYTES} (a hop header's limit)")
        return value

    @field_validator("test_only_perturb")
    @classmethod
    def _perturb(cls, value: float) -> float:
        if value < 0.0:
            raise ValueError("must be >= 0")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value):
        return value.lower() if isinstance(value, str) else value

    @field_validator("log_level", "log_format")
    @classmethod
    def _known(cls, value: str, info):
        allowed = LEVELS if info.field_name == "log_level" else FORMATS
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return value

    @field_validator("speculative")
    @classmethod
    def _speculative(cls, value: str) -> str:
        if value not in ("auto", "greedy", "all", "off"):
            raise ValueError("expected one of auto, greedy, all, off")
        return value

    @field_validator("quantization", mode="before")
    @classmethod
    def _quantization(cls, value):
        value = value.value if isinstance(value, Precision) else str(value).strip().lower()
        if value not in QUANTIZATION_CHOICES:
            raise ValueError(f"expected one of {', '.join(QUANTIZATION_CHOICES)}")
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value):
        value = str(value).strip().lower()
        if value not in DTYPE_CHOICES:
            raise ValueError(f"expected one of {', '.join(DTYPE_CHOICES)}")
        return value

    @field_validator("quant_group_size")
    @classmethod
    def _group(cls, value: int) -> int:
        if value not in GROUP_SIZES:
            raise ValueError(f"expected one of {', '.join(map(str, GROUP_SIZES))}")
        return value

    @field_validator("guess_steps")
    @classmethod
    def _guess_steps(cls, value: int) -> int:
        if not 0 <= value <= 16:
            raise ValueError("expected 0..16")
        return value

    @field_validator("max_draft_tokens")
    @classmethod
    def _drafts(cls, value: int) -> int:
        if not 1 <= value <= 32:
            raise ValueError("expected 1..32")
        return value

    # -- derived --

    @property
    def explicit_shard(self) -> bool:
        """All of model id and range given (none given: the tracker assigns them)."""
        return None not in (self.model_id, self.shard_start, self.shard_end)

    @property
    def layers(self) -> LayerRange:
        """The range; ValueError naming the flags when it is missing or empty."""
        return check_range(self.shard_start, self.shard_end, None)

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * 2**20)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_frame_mb * 2**20)

    def precision_for(self, native: str | None) -> Precision:
        """The precision this process serves a checkpoint in: --quantization and --dtype
        resolved with the checkpoint's shipped format ``native`` (fp8, mxfp4 or None);
        InvalidRequest for fp8/mxfp4 asked of a checkpoint that does not ship it."""
        return resolve_precision(self.quantization, self.dtype, native)

    def compute_dtype_for(self, precision: Precision, *, gguf: bool = False) -> str:
        """The compute dtype a shard of ``precision`` runs in (float32 for float32; auto:
        float32 for a ``gguf`` checkpoint)."""
        return compute_dtype_name(precision, self.dtype, gguf=gguf)

    def precision_fields(self, precision: Precision, dtype: str) -> dict:
        """How a node of ``precision`` computing in ``dtype`` (resolved) declares it
        (``NodeAnnouncement`` fields); the group size only for int4."""
        group = self.quant_group_size if precision is Precision.INT4 else None
        return {"quantization": precision, "dtype": dtype, "quant_group_size": group}

    def shard_values(self) -> dict:
        """This object's ``ShardSettings`` fields: what a derived node's settings inherit."""
        return {n: getattr(self, n) for n in ShardSettings.model_fields}


def check_range(start: int | None, end: int | None, num_layers: int | None) -> LayerRange:
    """The range from the flags, refused in one line when the model has no such layers."""
    try:
        layers = LayerRange(start, end)
        if num_layers is not None:
            layers.check_within(num_layers)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--shard-start/--shard-end: {exc}") from exc
    return layers


def check_exposure(host: str, swarm_token: str | None, insecure: bool) -> None:
    """Safe defaults (docs/adr/0032): listening beyond this machine needs a swarm token,
    or the operator's explicit --insecure."""
    if swarm_token or insecure or is_loopback(host):  # a name may resolve anywhere
        return
    raise ValueError(
        f"--host {host} is reachable from other machines: give --swarm-token (or "
        "MESHNET_SWARM_TOKEN) so only your nodes join, or --insecure for an open swarm"
    )


def check_advertise_url(url: str | None) -> None:
    """A URL other machines could dial: http(s), a host that is not a wildcard, a port."""
    if url is None:
        return
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--advertise-url {url}: expected http://HOST:PORT")
    if parts.hostname in ("0.0.0.0", "::") or parts.path not in ("", "/"):
        raise ValueError(
            f"--advertise-url {url}: give this machine's address as other machines dial it "
            "(e.g. http://192.168.1.20:8000), not a wildcard or a path"
        )
