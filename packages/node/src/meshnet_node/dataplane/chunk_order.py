"""The order of a node's steps that wait for others of their session: pipelined prompt
chunks, taken in order and gathered into their prompt call (ADR-0010, ADR-0053), and a
replay's passes (ADR-0023). ``ChunkOrder`` owns each session's condition and the chunks
waiting for their turn; ``NodeService`` runs the passes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from meshnet_common.errors import Conflict, NotFound
from meshnet_node.dataplane.steps import Step
from meshnet_node.engine.sessions import Session
from meshnet_node.settings import NodeSettings

T = TypeVar("T")


@dataclass
class Waiting:
    """A prefill chunk waiting for its turn; another chunk's pass may take it along."""

    req: Step
    tensor: torch.Tensor
    future: asyncio.Future
    taken: bool = False


class ChunkOrder:
    """Who waits for whom among a node's sessions' steps. ``session_of``: a session by id
    (None: not open here); ``settings``: its ``turn_timeout_s`` and ``open_timeout_s``."""

    def __init__(self, session_of: Callable[[str], Session | None], settings: NodeSettings) -> None:
        self.session_of = session_of
        self.settings = settings
        self._turns: dict[str, asyncio.Condition] = {}
        # Prefill chunks waiting for their turn, per session and position: the chunk whose
        # turn comes takes the rest of its prompt call along into one compute pass.
        self._waiting: dict[str, dict[int, Waiting]] = {}

    def watched(self, session_id: str) -> bool:
        """Whether anything has waited on ``session_id``'s order."""
        return session_id in self._turns

    def enter(self, req: Step, tensor: torch.Tensor) -> Waiting:
        """``req``'s chunk (its input ``tensor``) waits here until its turn."""
        waiting = self._waiting.setdefault(req.session_id, {})
        if req.position in waiting:
            raise Conflict(f"a chunk at position {req.position} is already waiting", code="dup")
        me = Waiting(req, tensor, asyncio.get_running_loop().create_future())
        waiting[req.position] = me
        return me

    def take(self, run: list[Waiting]) -> None:
        """``run``'s chunks go into one pass: no longer waiting, the later ones taken along."""
        waiting = self._waiting.get(run[0].req.session_id, {})
        for member in run[1:]:
            member.taken = True
        for member in run:
            if waiting.get(member.req.position) is member:
                del waiting[member.req.position]

    async def leave(self, me: Waiting) -> None:
        """``me`` is done waiting (its pass ran, or failed): the next chunk may go."""
        session_id = me.req.session_id
        waiting = self._waiting.get(session_id)
        if waiting is not None:
            if waiting.get(me.req.position) is me:
                del waiting[me.req.position]
            if not waiting:
                del self._waiting[session_id]
        await self.advance(session_id)

    async def drop(self, session_id: str) -> None:
        """``session_id`` closed: its waiting chunks fail, nothing waits on it any more."""
        for member in self._waiting.pop(session_id, {}).values():
            if not member.future.done():  # its waiter wakes below and raises this
                member.taken = True
                member.future.set_exception(NotFound(f"session {session_id!r} was closed"))
        await self.advance(session_id)
        self._turns.pop(session_id, None)

    async def _until(self, session_id: str, ready: Callable[[], T], timeout_s: float) -> T:
        """``ready()`` once it is true (checked again at every ``advance`` of the
        session); TimeoutError after ``timeout_s``."""
        value = ready()
        if value:
            return value
        cond = self._turns.get(session_id)
        if cond is None:
            cond = self._turns[session_id] = asyncio.Condition()
        async with cond:
            return await asyncio.wait_for(cond.wait_for(ready), timeout_s)

    async def wait_for_turn(self, req: Step, me: Waiting | None = None) -> None:
        """Pipelined prefill chunks may arrive out of order: wait until ours is next (or
        until an earlier chunk's pass took ours along)."""
        if req.chunk == 0:
            return

        def session():
            return self.session_of(req.session_id)

        def ready() -> bool:
            if me is not None and me.taken:
                return True
            current = session()
            return current is not None and current.length >= req.position

        # An earlier chunk of a live session may still be computing; chunk 0 (which opens
        # the session) is never that far behind.
        settings = self.settings
        timeout = settings.turn_timeout_s if session() is not None else settings.open_timeout_s
        try:
            await self._until(req.session_id, ready, timeout)
        except TimeoutError as exc:
            if me is not None and me.taken:  # a long merged pass holds our result
                return
            if session() is None:
                self._turns.pop(req.session_id, None)  # nothing will ever wake it
                raise NotFound(f"unknown session {req.session_id!r}") from exc
            raise Conflict(
                f"chunk at position {req.position} never became next for session {req.session_id}",
                code="wrong_position",
            ) from exc

    async def wait_for_open(self, req: Step) -> None:
        """A later chunk of a prompt that overtook the first (which opens the session here:
        a call's chunks travel on together, ADR-0053) waits for the session to open."""

        def opened() -> bool:
            return self.session_of(req.session_id) is not None

        try:
            await self._until(req.session_id, opened, self.settings.open_timeout_s)
        except TimeoutError as exc:
            self._turns.pop(req.session_id, None)  # nothing will ever wake it
            raise NotFound(f"unknown session {req.session_id!r}") from exc

    async def wait_for_pass(self, req: Step) -> None:
        """A replay's pass n waits until pass n - 1 (or, for the first, the prompt) ran here."""

        def ready() -> bool:
            session = self.session_of(req.session_id)
            return (
                session is not None
                and session.replayed == req.replay_pass - 1
                and session.length >= req.position
            )

        try:
            await self._until(req.session_id, ready, self.settings.turn_timeout_s)
        except TimeoutError as exc:
            raise Conflict(
                f"replayed pass {req.replay_pass} of session {req.session_id} never became "
                "next", code="wrong_position",
            ) from exc  # fmt: skip

    async def advance(self, session_id: str) -> None:
        """Wake whatever waits on ``session_id``'s order (its state changed)."""
        cond = self._turns.get(session_id)
        if cond is not None:
            async with cond:
                cond.notify_all()

    async def call_chunks(self, me: Waiting, call_end: int) -> list[Waiting]:
        """``me`` and the chunks after it that make up its prompt call (ADR-0053): up to
        position ``call_end`` (``Session.call_end``) or the prompt's last chunk (the sampled
        one), waiting for those that have not arrived yet. A call's bits depend on its rows,
        so a pass never computes part of one; the head cut the prompt into the same calls."""
        session_id = me.req.session_id
        begin = me.req.position

        def gathered() -> list[Waiting] | None:
            waiting = self._waiting.get(session_id, {})
            run, end = [me], begin + me.tensor.shape[1]
            while not run[-1].req.sample and end < call_end:
                nxt = waiting.get(end)
                if nxt is None:
                    return None  # not here yet
                width = nxt.tensor.shape[1]
                if nxt.taken or nxt.req.session_key != me.req.session_key or end + width > call_end:
                    break  # not this call's: it fails, or runs, on its own
                run.append(nxt)
                end += width
            return run

        try:
            return await self._until(session_id, gathered, self.settings.turn_timeout_s)
        except TimeoutError as exc:
            raise Conflict(
                f"the prompt chunks after position {begin} of session {session_id} never "
                "arrived", code="wrong_position",
            ) from exc  # fmt: skip
