"""What goes into a stage's step and what comes out: a decode step in a batch
(``DecodeItem``), a step's output (``StepOutput``), and the checks on a step's input
(``step_input``: token ids on a head, hidden states elsewhere, of the shard's sizes and
types, 1 to ``limit`` rows, checked before any layer runs so that a rejected step leaves
its session as it was, an HTTP 400 with the field's name).

A decode step crosses the event loop with no torch call on its way (docs/adr/0011): its
input arrives as a ``wire.WireTensor`` (``is_decode_input`` checks its dtype and shape) and
becomes a tensor on the compute thread (``DecodeItem.made``), which also turns the output
into the next hop's frame (``DecodeItem.encode``, ``StepOutput.frame``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from meshnet_common.errors import InvalidRequest
from meshnet_common.wire import WireTensor
from meshnet_node.engine.loader import LoadedShard
from meshnet_node.engine.sampling import SampledToken

if TYPE_CHECKING:
    from meshnet_node.engine.ahead import Ahead

_ACCEPTED_HIDDEN_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class DecodeItem:
    """One session's single-token step inside a batched decode call."""

    session_id: str
    position: int
    token_ids: torch.Tensor | WireTensor | None = None  # a WireTensor: made on the compute
    hidden: torch.Tensor | WireTensor | None = None  # thread (``made``)
    owner: str | None = None
    sample: bool = True
    guess_from: int | None = None  # a guess step (ADR-0019): may be rewound back to here
    ahead: Ahead | None = None  # head and tail: may run on with what it samples (ADR-0047)
    # The output's hidden states as the next hop's frame, on the compute thread
    encode: Callable[[torch.Tensor], bytes] | None = None

    def made(self) -> DecodeItem:
        """This item with its input a tensor (on the compute thread)."""
        ids, hidden = self.token_ids, self.hidden
        if isinstance(ids, WireTensor):
            ids = ids.tensor()
        if isinstance(hidden, WireTensor):
            hidden = hidden.tensor()
        if ids is self.token_ids and hidden is self.hidden:
            return self
        return replace(self, token_ids=ids, hidden=hidden)


@dataclass
class StepOutput:
    """What a stage produces: hidden states (head/middle) or last-token logits (tail)."""

    hidden: torch.Tensor | None = None  # (1, T, H) in the stage's activation dtype
    # (V,) float32, tail only; verifying drafts (k + 1, V), or, where the tail verified
    # them, the rows verification read (``DeferredRows``)
    logits: torch.Tensor | None = None
    token: SampledToken | None = None  # tail only, when the session samples
    more: list[SampledToken] | None = None  # after ``token``: the tail kept drafts (ADR-0019)
    compute_s: float = 0.0  # time on the compute thread (shared by a batch's steps)
    frame: bytes | None = None  # ``hidden`` as the next hop's frame (``DecodeItem.encode``)


def is_decode_input(shard: LoadedShard, value: WireTensor) -> bool:
    """Whether ``value`` is a one-token input of ``shard`` (token ids on a head, hidden
    states elsewhere, as ``step_input`` takes them), read without a torch call. Anything
    else is made a tensor and checked by ``step_input``, which names what is wrong."""
    shape = value.shape
    if shard.is_head:
        return value.dtype in (torch.int64, torch.int32) and shape == (1, 1)
    return value.dtype in _ACCEPTED_HIDDEN_DTYPES and shape == (1, 1, shard.hidden_size)


def step_input(
    shard: LoadedShard,
    token_ids: torch.Tensor | None,
    hidden: torch.Tensor | None,
    *,
    limit: int,
    values: bool = True,
) -> torch.Tensor:
    """A step's input for ``shard``, shaped (1, T) ids or (1, T, H) hidden; ``values=False``
    checks types and shapes only, not token ranges or finiteness."""
    if shard.is_head:
        if token_ids is None or hidden is not None:
            raise InvalidRequest("the head stage takes token ids", param="token_ids")
        if token_ids.dtype not in (torch.int64, torch.int32):
            raise InvalidRequest(f"token ids must be integers, got {token_ids.dtype}")
        ids = token_ids.reshape(1, -1).to(torch.int64)  # (1, T)
        vocab = shard.vocab_size
        if values and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise InvalidRequest(
                f"token ids must lie in [0, {shard.vocab_size})", param="token_ids"
            )
        tensor = ids
    else:
        if hidden is None or token_ids is not None:
            raise InvalidRequest("this stage takes hidden states", param="hidden")
        if hidden.dtype not in _ACCEPTED_HIDDEN_DTYPES:
            raise InvalidRequest(
                f"hidden states must be bfloat16 or float32, got {hidden.dtype}",
                param="hidden",
            )
        if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[2] != shard.hidden_size:
            raise InvalidRequest(
                f"hidden states must have shape (1, T, {shard.hidden_size}), "
                f"got {tuple(hidden.shape)}",
                param="hidden",
            )
        if values and not torch.isfinite(hidden).all():
            raise InvalidRequest("hidden states contain NaN or inf", param="hidden")
        tensor = hidden
    num_tokens = tensor.shape[1]
    if not 0 < num_tokens <= limit:
        raise InvalidRequest(
            f"a step carries 1..{limit} tokens, got {num_tokens}", param="num_tokens"
        )
    return tensor
