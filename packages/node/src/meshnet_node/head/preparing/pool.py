"""Where a head plans requests (tokenizing prompts, rendering the chat template, compiling
a grammar): a few threads, never the event loop, each request within a time limit.

Past the limit the request is answered (400 ``request_too_complex``) and its work is told to
stop: the thread's profile hook (``sys.setprofile``, that thread only) raises
``PreparationStopped`` at the work's next Python call, which ends a runaway Jinja render
(the sandbox's loops call into Python every iteration or ``range``). Work inside one long C
call (a tokenizer, a grammar compiler) cannot be interrupted: its thread keeps its slot until
it really ends. The slots count the work running, not the requests waiting, so runaway work
never piles up more threads than there are slots; while every slot is held a new request
waits for one only within the same limit, then is refused with a retryable 503
(``preparation_busy``) rather than a 400 that blames it, and its work never starts
(issue 52). A client cannot hand the template code of its own (``templates``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from meshnet_common.errors import CapacityExceeded, InvalidRequest
from meshnet_common.logs import event

logger = logging.getLogger(__name__)
T = TypeVar("T")
BUSY = "preparation_busy"


class PreparationStopped(BaseException):
    """Raised inside work past its limit; a ``BaseException``, so that no ``except
    Exception`` on the way (a template's error handling) carries on with the work."""


class _Stop:
    """One piece of work's stop switch, read by its thread's profile hook."""

    def __init__(self) -> None:
        self.asked = False
        self.active = True  # False once the work has returned: the hook never fires after

    def hook(self, _frame, _event, _arg) -> None:
        if self.asked and self.active:
            raise PreparationStopped("preparation stopped: past --prepare-timeout")


def _stoppable(stop: _Stop, work: Callable[..., T], *args) -> T:
    sys.setprofile(stop.hook)  # this thread only
    try:
        return work(*args)
    finally:
        stop.active = False  # (an attribute store: no profile event before it)
        sys.setprofile(None)


class PreparePool:
    """``threads`` planning slots; a slot is held from the start of its work to its end."""

    def __init__(self, threads: int, timeout_s: float) -> None:
        self.threads = threads
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="prepare")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        self.held = 0  # slots whose work has not ended (past its deadline or not)

    def _slots_on(self, loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
        if self._loop is not loop:  # the slots live on the loop that serves
            self._loop, self._slots, self.held = loop, asyncio.Semaphore(self.threads), 0
        return self._slots

    def _freed(self, slots: asyncio.Semaphore) -> None:
        if slots is self._slots:
            self.held -= 1
            slots.release()

    async def run(self, work: Callable[..., T], *args, param: str) -> T:
        """``work(*args)`` on a slot's thread, waiting for a slot and working within
        ``timeout_s`` together: a 503 when no slot freed in time, a 400 naming ``param``
        when the work did not end in time."""
        loop = asyncio.get_running_loop()
        slots = self._slots_on(loop)
        deadline = loop.time() + self.timeout_s
        try:
            if slots.locked():  # every slot held: wait for one, within the limit
                await asyncio.wait_for(slots.acquire(), self.timeout_s)
            else:
                await slots.acquire()  # free: taken at once
        except TimeoutError:
            event(logger, logging.WARNING, "preparation refused: every slot is held",
                  slots=self.threads)  # fmt: skip
            raise CapacityExceeded(
                f"all {self.threads} request-preparing threads stayed busy for "
                f"{self.timeout_s:g} s (a preparation past its limit holds its thread until it "
                "ends): retry later or elsewhere", code=BUSY,
            ) from None  # fmt: skip
        self.held += 1

        def done(_running: Future) -> None:  # on the worker: the slot frees on the loop
            with contextlib.suppress(RuntimeError):  # a closed loop: nothing waits on them
                loop.call_soon_threadsafe(self._freed, slots)

        stop = _Stop()
        try:
            running = self._executor.submit(_stoppable, stop, work, *args)
        except BaseException:
            self._freed(slots)
            raise
        running.add_done_callback(done)  # the slot frees when the work really ends
        try:
            return await asyncio.wait_for(asyncio.wrap_future(running), deadline - loop.time())
        except TimeoutError:
            stop.asked = True  # the work ends at its next Python call
            raise InvalidRequest(
                f"preparing the request (tokenizing, chat template, JSON schema) took over "
                f"{self.timeout_s:g} s, the limit per request: send fewer or shorter "
                "prompts or a simpler schema", param=param, code="request_too_complex",
            ) from None  # fmt: skip
        except asyncio.CancelledError:  # the client left: its work stops too
            stop.asked = True
            raise
