"""The step message: one forward step as it crosses a hop (``Step``, written to and read
from HTTP headers, or as bytes: ``step_bytes``; its tensor travels as the body) — and its
answer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, NamedTuple

from pydantic import Field, StrictBool, StrictInt

from meshnet_common import wire
from meshnet_common.errors import InvalidRequest
from meshnet_common.protocol import (
    H_ANSWER_TO,
    H_CHUNK,
    H_COMPUTE,
    H_DRAFTS,
    H_GUESS,
    H_IDS,
    H_OPEN,
    H_POSITION,
    H_REPLAY_PASS,
    H_ROUTE,
    H_SAMPLE,
    H_SESSION,
    H_SESSION_KEY,
    SamplingSpec,
    validate_session_id,
)

_HASH = r"^[0-9a-f]{32}$"  # a prefix block's hash (meshnet_node.caching.blocks)
_OPENING = {"start_layer", "audit", "prefix_seed", "prefix", "prompt_call"}  # OpenSpec's own fields


class OpenSpec(SamplingSpec):
    """The open header (``H_OPEN``), one flat JSON object: the session's sampling, the global
    layer the receiving hop enters its shard at (None: its first), whether every hop keeps
    the session's inputs for audits (docs/adr/0026; on the wire only when true), and the
    prefix cache's (docs/adr/0035): the seed of the session's block hashes (None: it leaves
    nothing cached) and the hashes of the cached blocks it starts after; the most rows of
    its prompt one call computes, as the head chose (ADR-0053; None: the hop's own)."""

    start_layer: StrictInt | None = Field(default=None, ge=0)
    audit: StrictBool = False
    prefix_seed: str | None = Field(default=None, pattern=_HASH)
    prefix: tuple[Annotated[str, Field(pattern=_HASH)], ...] = Field(default=(), max_length=4096)
    prompt_call: StrictInt | None = Field(default=None, ge=1)

    @classmethod
    def of(cls, sampling: SamplingSpec, *, start_layer: int, **opening) -> OpenSpec:
        return cls(**sampling.model_dump(), start_layer=start_layer, **opening)

    @property
    def sampling(self) -> SamplingSpec:
        return SamplingSpec.model_validate(self.model_dump(exclude=_OPENING))

    def entering(self, start_layer: int) -> OpenSpec:
        """The same opening for the next hop, which enters at ``start_layer``."""
        return self.model_copy(update={"start_layer": start_layer})

    def to_header(self) -> str:  # the opening's own fields on the wire only when set
        unset = {"audit": not self.audit, "prefix_seed": self.prefix_seed is None,
                 "prefix": not self.prefix, "prompt_call": self.prompt_call is None}  # fmt: skip
        return self.model_dump_json(exclude={k for k, v in unset.items() if v})


class StepAnswer(NamedTuple):
    """A step's answer as it goes back up the chain: the tail's answer bytes
    (``answer_bytes``: a ``StepResult`` without compute times) and the
    ``x-meshnet-compute-ms`` header, this hop's time first."""

    body: bytes
    compute_ms: str


def stale_guess(stage, req: Step) -> bool:
    """Whether a guess step reaching the tail guessed wrong (or follows one that did): the
    tail did not sample its token at its position (ADR-0019). Such a step computes nothing
    here; the hops before it computed it, and the head's next step rewinds them."""
    session = stage.sessions.get(req.session_id, owner=req.session_key)
    return req.ids is None or session.expect != (req.position, req.ids[0])


LOGPROB_FLOOR = -1e30  # how a log-probability of -inf (or NaN) travels: JSON has neither


def wire_logprob(value: float) -> float:
    value = float(value)
    return value if math.isfinite(value) else LOGPROB_FLOOR


@dataclass(frozen=True)
class Step:
    """One forward step as it crosses a hop, both ways: the head builds it, a hop relays it
    (``dataclasses.replace``: the route after the next hop, the opening entering where this
    stage ends) and the next hop parses it. Not its tensor, which travels as the body.
    ``to_headers`` and ``from_headers`` are its one codec (docs/adr/0011)."""

    session_id: str
    session_key: str | None
    position: int
    chunk: int = 0
    route: tuple[str, ...] = ()  # the hops after the one receiving it
    open_spec: OpenSpec | None = None  # opens the session there first (with its first chunk)
    sample: bool = False  # the tail samples this step's last token
    ids: tuple[int, ...] | None = None  # the step's token ids (penalties at the tail)
    drafts: int = 0  # how many of the last tokens are drafts to verify (ADR-0019)
    answer_to: str | None = None  # the head's URL: the tail answers there too (ADR-0020)
    compute_before: str | None = None  # compute of the hops before (with answer_to)
    replay_pass: int = 0  # n > 0: a replay's n-th decode pass, run after pass n - 1 (ADR-0023)
    guess_from: int | None = None  # a guess step: later steps may go back to here (ADR-0019)

    @property
    def start_layer(self) -> int | None:
        return None if self.open_spec is None else self.open_spec.start_layer

    @property
    def audit(self) -> bool:
        """An opening step: every hop keeps the session's inputs (ADR-0026)."""
        return self.open_spec is not None and self.open_spec.audit

    @property
    def draft_ids(self) -> tuple[int, ...]:
        return self.ids[len(self.ids) - self.drafts :] if self.drafts and self.ids else ()

    def to_headers(self) -> dict[str, str]:
        headers = {
            "content-type": wire.CONTENT_TYPE,
            H_SESSION: self.session_id,
            H_SESSION_KEY: self.session_key or "",
            H_POSITION: str(self.position),
            H_CHUNK: str(self.chunk),
            H_SAMPLE: "1" if self.sample else "0",
        }
        if self.route:
            headers[H_ROUTE] = ",".join(self.route)
        if self.open_spec is not None:
            headers[H_OPEN] = self.open_spec.to_header()
        if self.ids is not None:
            headers[H_IDS] = ",".join(map(str, self.ids))
        if self.drafts:
            headers[H_DRAFTS] = str(self.drafts)
        if self.replay_pass:
            headers[H_REPLAY_PASS] = str(self.replay_pass)
        if self.guess_from is not None:
            headers[H_GUESS] = str(self.guess_from)
        if self.answer_to is not None:
            headers[H_ANSWER_TO] = self.answer_to
            if self.compute_before:
                headers[H_COMPUTE] = self.compute_before
        return headers

    @classmethod
    def from_headers(cls, headers) -> Step:
        """Validate a step's headers (InvalidRequest: a 400 naming the header)."""
        session_id = headers.get(H_SESSION)
        if not session_id:
            raise InvalidRequest(f"missing header {H_SESSION}", param=H_SESSION)
        validate_session_id(session_id, param=H_SESSION)
        open_spec = None
        if headers.get(H_OPEN):
            try:
                open_spec = OpenSpec.model_validate_json(headers[H_OPEN])
            except ValueError as exc:
                raise InvalidRequest(f"malformed {H_OPEN} header: {exc}", param=H_OPEN) from exc
        step = cls(
            session_id=session_id,
            session_key=headers.get(H_SESSION_KEY),
            position=_int_header(headers, H_POSITION),
            chunk=_int_header(headers, H_CHUNK, 0),
            route=parse_route(headers.get(H_ROUTE)),
            open_spec=open_spec,
            sample=headers.get(H_SAMPLE) == "1",
            ids=parse_ids(headers.get(H_IDS)),
            drafts=_int_header(headers, H_DRAFTS, 0),
            answer_to=parse_answer_to(headers.get(H_ANSWER_TO)),
            compute_before=headers.get(H_COMPUTE),
            replay_pass=_int_header(headers, H_REPLAY_PASS, 0),
            guess_from=_int_header(headers, H_GUESS) if H_GUESS in headers else None,
        )
        step.check()
        return step

    def check(self) -> None:
        """The rules between fields, whichever form the step came in (InvalidRequest)."""
        if self.guess_from is not None and (
            self.guess_from > self.position or self.ids is None or len(self.ids) != 1
            or not self.sample or self.drafts or self.chunk or self.open_spec is not None
        ):  # fmt: skip
            raise InvalidRequest(
                f"a step with {H_GUESS} is one sampled decode token, with its id ({H_IDS}), "
                "that may go back no further than its own position",
                param=H_GUESS,
            )
        if self.drafts and (self.ids is None or not self.sample or self.chunk):
            raise _bad_drafts()

    def check_tokens(self, tokens: int) -> None:
        """The headers that count the tokens of the step's tensor agree with it."""
        if self.ids is not None and len(self.ids) != tokens:
            raise InvalidRequest(
                f"header {H_IDS} needs one token id >= 0 per token of the step ({tokens})",
                param=H_IDS,
            )
        if self.drafts and self.drafts >= tokens:
            raise _bad_drafts()


def _bad_drafts() -> InvalidRequest:
    return InvalidRequest(
        f"a step with {H_DRAFTS} is one sampled step of its first token and the drafts "
        f"after it, with their ids ({H_IDS})",
        param=H_DRAFTS,
    )


def _int_header(headers, name: str, default: int | None = None) -> int:
    raw = headers.get(name)
    if raw is None:
        if default is None:
            raise InvalidRequest(f"missing header {name}", param=name)
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise InvalidRequest(f"header {name} must be an integer", param=name) from exc
    if value < 0:
        raise InvalidRequest(f"header {name} must be >= 0", param=name)
    return value


def parse_route(raw: str | None) -> tuple[str, ...]:
    if not raw:
        return ()
    hops = tuple(h.strip() for h in raw.split(",") if h.strip())
    for hop in hops:
        if not hop.startswith(("http://", "https://")) or len(hop) > 300:
            raise InvalidRequest(f"bad hop URL in route: {hop[:80]!r}", param=H_ROUTE)
    if len(hops) > 64:
        raise InvalidRequest("route too long", param=H_ROUTE)
    return hops


def parse_answer_to(raw: str | None) -> str | None:
    if raw is None:
        return None
    (url,) = parse_route(raw) or (None,)
    if url is None or "," in raw:
        raise InvalidRequest(f"header {H_ANSWER_TO} must be one http(s) URL", param=H_ANSWER_TO)
    return url.rstrip("/")


def parse_ids(raw: str | None) -> tuple[int, ...] | None:
    """The ids header: non-negative integers (one per token of the step's tensor)."""
    if raw is None:
        return None
    try:
        ids = tuple(int(v) for v in raw.split(","))
    except ValueError as exc:
        raise InvalidRequest(
            f"header {H_IDS} must be comma-separated integers", param=H_IDS
        ) from exc
    if any(i < 0 for i in ids):
        raise InvalidRequest(f"header {H_IDS} needs token ids >= 0", param=H_IDS)
    return ids
