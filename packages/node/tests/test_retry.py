"""The one retry policy (ADR-0007) on a fake clock: attempts, deadline, backoff cap, ban
expiry, and each user's parameters (failover, registration, waiting for the tracker,
resuming a download). Nothing here sleeps for real."""

from __future__ import annotations

import asyncio
from dataclasses import astuple
from types import SimpleNamespace

import httpx
import pytest

from meshnet_common.errors import HopError, ModelNotCovered
from meshnet_common.protocol import StepResult
from meshnet_node.head.chain import Chain, GenerationRequest
from meshnet_node.head.failover import FAILOVER_BAN_S, FAILOVER_POLICY
from meshnet_node.head.generation import HeadGenerator
from meshnet_node.retry import BanList, RetryPolicy
from meshnet_node.swarm import membership as membership_module
from meshnet_node.swarm.fetch import RESUME_RETRY
from meshnet_node.swarm.joining import TRACKER_WAIT_RETRY, wait_for_tracker
from meshnet_node.swarm.membership import REGISTRATION_RETRY, Membership


class FakeClock:
    """Monotonic seconds that move only when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.advance(seconds)

    async def async_sleep(self, seconds: float) -> None:
        self.sleep(seconds)


# -- the policy ---------------------------------------------------------------------------


def test_attempts_count_the_first_try():
    budget = RetryPolicy(max_attempts=3).start(FakeClock())
    assert not budget.exhausted()
    assert budget.failed() and budget.failed()  # two failures: a third attempt may run
    assert not budget.failed()  # the third failure ends it
    assert budget.exhausted() and budget.failures == 3


def test_the_deadline_ends_retrying_whatever_attempts_are_left():
    clock = FakeClock()
    budget = RetryPolicy(max_attempts=100, deadline_s=10.0).start(clock)
    assert budget.deadline == clock.now + 10.0
    clock.advance(9.5)
    assert budget.failed()
    assert budget.remaining() == pytest.approx(0.5)
    clock.advance(0.5)  # the deadline has come
    assert budget.remaining() == 0.0
    assert not budget.failed() and budget.exhausted()
    clock.advance(5)
    assert budget.remaining() == 0.0


def test_backoff_doubles_from_the_base_up_to_the_cap():
    policy = RetryPolicy(max_attempts=None, backoff_base_s=0.2, backoff_cap_s=2.0)
    assert [policy.delay(n) for n in range(1, 8)] == pytest.approx(
        [0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]
    )
    assert policy.delay(10**9) == 2.0  # no overflow however long it retries
    budget = policy.start(FakeClock())
    assert budget.backoff() == pytest.approx(0.2)  # before any failure: the first wait
    budget.failed()
    budget.failed()
    assert budget.backoff() == pytest.approx(0.4)
    with pytest.raises(ValueError):
        policy.delay(0)


def test_no_limit_must_be_asked_for_and_is_visible():
    unbounded = RetryPolicy(max_attempts=None)
    assert not unbounded.bounded
    assert RetryPolicy(max_attempts=None, deadline_s=1.0).bounded
    assert RetryPolicy(max_attempts=1).bounded
    budget = unbounded.start(FakeClock())
    assert all(budget.failed() for _ in range(10_000))
    with pytest.raises(TypeError):
        RetryPolicy()  # type: ignore[call-arg]  # max_attempts has no default
    for bad in ({"max_attempts": 0}, {"max_attempts": 1, "deadline_s": -1.0},
                {"max_attempts": 1, "backoff_base_s": -0.1}):  # fmt: skip
        with pytest.raises(ValueError):
            RetryPolicy(**bad)


def test_bans_expire():
    clock = FakeClock()
    bans = BanList(30.0, clock)
    bans.ban("http://a")
    assert bans.until("http://a") == clock.now + 30.0
    bans.ban("http://b", until=clock.now + 5.0)
    assert bans.banned() == {"http://a", "http://b"}
    clock.advance(5.0)  # b's ban ends exactly now
    assert bans.banned() == {"http://a"}
    assert bans.banned(now=clock.now - 1.0) == {"http://a", "http://b"}
    bans.expire()
    assert bans.until("http://b") is None
    clock.advance(20.0)
    bans.ban("http://a")  # a new ban replaces the old one
    clock.advance(20.0)
    assert bans.banned() == {"http://a"} and len(bans) == 1
    clock.advance(10.0)
    assert bans.banned() == frozenset()


# -- each user's parameters ---------------------------------------------------------------


def test_each_use_has_its_parameters():
    # (max_attempts, deadline_s, backoff_base_s, backoff_cap_s)
    assert astuple(FAILOVER_POLICY) == (5, 120.0, 0.2, 2.0)  # first try + 4 failovers
    assert FAILOVER_BAN_S == 30.0
    assert astuple(RESUME_RETRY) == (3, None, 0.0, 0.0)
    assert TRACKER_WAIT_RETRY.max_attempts is None and TRACKER_WAIT_RETRY.delay(5) == 1.0
    # the one unbounded loop: registering until the tracker accepts, refuses, or we stop
    assert not REGISTRATION_RETRY.bounded
    assert [REGISTRATION_RETRY.delay(n) for n in range(1, 7)] == [0.5, 1, 2, 4, 5, 5]


def test_waiting_for_the_tracker_gives_up_at_the_deadline():
    clock = FakeClock()

    def refused(url, timeout, **_):
        clock.advance(0.25)  # each try takes a while
        raise httpx.ConnectError("refused")

    with pytest.raises(OSError, match="unreachable after 3s"):
        wait_for_tracker("http://t", 3.0, clock=clock, sleep=clock.sleep, get=refused)
    assert clock.slept == pytest.approx([1.0, 1.0, 0.25])  # the last wait ends at the deadline


def test_waiting_for_the_tracker_returns_once_it_answers():
    clock, calls = FakeClock(), []

    def answers_third_time(url, timeout, **_):
        calls.append(url)
        if len(calls) < 3:
            raise httpx.ConnectError("refused")
        return httpx.Response(200)

    wait_for_tracker("http://t/", 60.0, clock=clock, sleep=clock.sleep, get=answers_third_time)
    assert calls == ["http://t/health"] * 3 and clock.slept == [1.0, 1.0]


def _membership(retry=REGISTRATION_RETRY) -> Membership:
    return Membership("http://127.0.0.1:9", lambda: None, lambda: None, 1.0, retry=retry)


def test_registration_retries_with_capped_backoff_until_accepted(monkeypatch):
    member = _membership()
    failures = iter(range(8))
    waits: list[float] = []

    def register_once():
        if next(failures, None) is not None:
            raise httpx.ConnectError("tracker still starting")
        return "accepted"

    monkeypatch.setattr(member, "register_once", register_once)
    monkeypatch.setattr(member._stop, "wait", waits.append)
    assert member.register_until_accepted()
    assert waits == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0]
    member._client.close()


def test_registration_stops_when_refused_or_out_of_a_bounded_budget(monkeypatch):
    member = _membership(RetryPolicy(max_attempts=2, backoff_base_s=0.1, backoff_cap_s=0.1))
    waits: list[float] = []
    monkeypatch.setattr(member._stop, "wait", waits.append)

    def unreachable():
        raise httpx.ConnectError("down")

    monkeypatch.setattr(member, "register_once", unreachable)
    assert not member.register_until_accepted()
    assert waits == [0.1]

    def refused():
        raise membership_module.RegistrationRefused("wrong token")

    monkeypatch.setattr(member, "register_once", refused)
    assert not member.register_until_accepted()
    assert member.refused == "wrong token"
    member._client.close()


# -- generation failover ------------------------------------------------------------------


class FailingChain:
    """A HeadGenerator whose hops fail as scripted: each entry of ``script`` is an exception
    to raise on an attempt, or None for an attempt that succeeds."""

    def __init__(self, script, routes=None, policy=FAILOVER_POLICY) -> None:
        self.clock = FakeClock()
        service = SimpleNamespace(
            stage=SimpleNamespace(shard=SimpleNamespace(is_head=True)),
            metrics=SimpleNamespace(failovers=SimpleNamespace(inc=lambda: None)),
            settings=SimpleNamespace(threads=1, prefix_cache=False),
        )
        tokenizer = SimpleNamespace(eos_token_id=None)
        self.gen = HeadGenerator(
            service, tokenizer, failover_policy=policy, clock=self.clock,
            sleep=self.clock.async_sleep,
        )  # fmt: skip
        self.script = list(script)
        self.routes = list(routes or [])
        self.excluded: list[frozenset[str]] = []
        self.attempt_times: list[float] = []

        async def attempt(*args, **kwargs):
            self.attempt_times.append(self.clock.now)
            outcome = self.script.pop(0)
            if outcome is not None:
                raise outcome
            return StepResult(token_id=7)

        async def nothing(*args, **kwargs):
            return None

        passes = self.gen.passes  # the generator's failover runs its passes through these
        passes.prefill = attempt
        passes.step = attempt
        passes.close = nothing
        passes.open = lambda *args: None

    async def reroute(self, exclude: frozenset[str]) -> tuple[str, ...]:
        self.excluded.append(exclude)
        route = self.routes.pop(0) if self.routes else ("http://spare",)
        if isinstance(route, Exception):
            raise route
        return route

    def run(self, chain: Chain | None = None):
        chain = chain or Chain(route=("http://a", "http://b"))
        request = GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=4)
        coro = self.gen.failover.advance(None, chain, request, [1, 2, 3], None, self.reroute)
        return asyncio.run(coro), chain


def hop(url: str, status: int = 502) -> HopError:
    return HopError(f"{url} failed", status=status, hop=url)


def test_a_request_survives_four_failovers_with_capped_backoff():
    fake = FailingChain([hop(f"http://n{i}") for i in range(4)] + [None])
    result, chain = fake.run()
    assert result.token_id == 7 and chain.failovers == 4 and chain.replay is False
    assert fake.clock.slept == pytest.approx([0.2, 0.4, 0.8, 1.6])
    bans = fake.gen.failover.bans
    assert bans.banned() == {f"http://n{i}" for i in range(4)}
    assert bans.until("http://n0") == pytest.approx(1000.0 + FAILOVER_BAN_S)
    assert fake.excluded[-1] == {f"http://n{i}" for i in range(4)}


def test_the_fifth_failure_of_a_request_reaches_the_client():
    fake = FailingChain([hop(f"http://n{i}") for i in range(5)] + [None])
    with pytest.raises(HopError, match="n4 failed"):
        fake.run()
    assert len(fake.clock.slept) == 4


def test_the_budget_is_per_request_not_per_step():
    fake = FailingChain([hop("http://x"), None, hop("http://y"), None])
    _, chain = fake.run()
    budget = chain.budget
    fake.run(chain)  # the next step of the same request goes on with the same budget
    assert chain.budget is budget and chain.failovers == 2


def test_no_failover_after_the_request_deadline():
    fake = FailingChain([hop("http://a"), hop("http://b"), None])
    chain = Chain(route=("http://a",))
    real_attempt = fake.gen.passes.prefill

    async def slow_attempt(*args, **kwargs):
        fake.clock.advance(61.0)  # two attempts of 61 s pass the 120 s deadline
        return await real_attempt(*args, **kwargs)

    fake.gen.passes.prefill = slow_attempt
    with pytest.raises(HopError, match="http://b failed"):
        fake.run(chain)
    assert chain.failovers == 2 and len(fake.clock.slept) == 1


def test_a_ban_expires_and_a_full_node_is_avoided_without_a_ban():
    fake = FailingChain([hop("http://a"), hop("http://busy", status=503), None])
    fake.run()
    assert fake.gen.failover.bans.banned() == {"http://a"}
    assert fake.excluded == [{"http://a"}, {"http://a", "http://busy"}]
    fake.clock.advance(FAILOVER_BAN_S)
    assert fake.gen.failover.bans.banned() == frozenset()


def test_a_missing_replacement_route_uses_the_same_budget():
    missing = ModelNotCovered("layers [10, 20) not covered")
    fake = FailingChain([hop("http://a"), None], routes=[missing, missing, ("http://c",)])
    _, chain = fake.run()
    assert chain.failovers == 3 and chain.route == ("http://c",)
    assert fake.clock.slept == pytest.approx([0.2, 0.4, 0.8])
    fake = FailingChain([hop("http://a"), None], routes=[missing] * 5)
    with pytest.raises(ModelNotCovered):
        fake.run()
    assert fake.excluded == [{"http://a"}] * 4  # 1 hop failure + 4 lookups = 5 failures


def test_an_unrecoverable_error_is_not_retried():
    fake = FailingChain([HopError("bad request", status=400, hop="http://a"), None])
    with pytest.raises(HopError, match="bad request"):
        fake.run()
    assert fake.clock.slept == [] and fake.excluded == []
