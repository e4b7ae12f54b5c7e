"""Failover replays the computation it replaces (docs/adr/0023), in bfloat16, with weights
in bfloat16 and packed at int4 (ADR-0031: decode rows never depend on their batch).

In-process: a head [0, 2), two replicas of [2, 4) and a tail [4, 6) of the tiny llama, all in
bfloat16, reaching each other through ASGI transports. The first replica "dies" (its
transport refuses) after a number of steps; the head fails over to the second and replays.
The replacement session must see the very passes the lost one saw (the prompt in the same
chunks, then every decode pass with its drafts), and the text must be the undisturbed run's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient
from inprocess_hops import HttpxHops

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.dataplane import answer_bytes
from meshnet_node.runtime import build_runtime, create_app
from meshnet_node.settings import NodeSettings
from meshnet_node.speculation.drafting import DraftPolicy, NgramDrafter, SpeculationSettings

MODEL_ID = "meshnet-tiny/llama"
A, B, TAIL = "http://mid-a.test", "http://mid-b.test", "http://tail.test"
GREEDY = {"temperature": 0, "ignore_eos": True}


class Hops(httpx.AsyncBaseTransport):
    """Dispatches on the URL's host to in-process apps; a host in ``dead`` refuses, and
    ``die_after[host] = n`` makes it refuse from its n-th forward step on."""

    def __init__(self, apps: dict) -> None:
        self.transports = {h: httpx.ASGITransport(app=a) for h, a in apps.items()}
        self.dead: set[str] = set()
        self.die_after: dict[str, int] = {}
        self.steps: dict[str, int] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/v1/forward":
            self.steps[host] = self.steps.get(host, 0) + 1
            if host in self.die_after and self.steps[host] >= self.die_after[host]:
                self.dead.add(host)
        if host in self.dead or host not in self.transports:
            raise httpx.ConnectError(f"{host} is gone", request=request)
        return await self.transports[host].handle_async_request(request)


def settings_for(snapshot: Path, start: int, end: int, quantization: str) -> NodeSettings:
    return NodeSettings(model_id=MODEL_ID, model_path=snapshot, layers=LayerRange(start, end),
                        quantization=quantization, prefix_cache=True)  # fmt: skip


@contextmanager
def node(snapshot: Path, start: int, end: int, route_provider=None, hops=None,
         quantization: str = Precision.BFLOAT16.value):  # fmt: skip
    async def no_route(_model_id, _exclude=frozenset()):
        return ()

    runtime = build_runtime(settings_for(snapshot, start, end, quantization),
                            route_provider=route_provider or no_route)  # fmt: skip
    if hops is not None:
        runtime.service.links.hops = HttpxHops(httpx.AsyncClient(transport=hops))
    app = create_app(runtime)
    with TestClient(app) as http:
        yield runtime, app, http


class Swarm:
    def __init__(self, snapshot: Path, stack: ExitStack, quantization: str) -> None:
        self.hops = Hops({})
        self.tail_runtime, tail_app, _ = stack.enter_context(
            node(snapshot, 4, 6, hops=self.hops, quantization=quantization)
        )
        self.hops.transports["tail.test"] = httpx.ASGITransport(app=tail_app)
        mids, self.mid_services = {}, []
        for url in (A, B):
            runtime, app, _ = stack.enter_context(
                node(snapshot, 2, 4, hops=self.hops, quantization=quantization)
            )
            mids[urlsplit(url).hostname] = app
            self.mid_services.append(runtime.service)
        self.hops.transports.update({h: httpx.ASGITransport(app=a) for h, a in mids.items()})

        async def route(_model_id, exclude=frozenset()):
            return (
                (A, TAIL) if A not in exclude and "mid-a.test" not in self.hops.dead else (B, TAIL)
            )

        self.head, _, self.http = stack.enter_context(
            node(snapshot, 0, 2, route, self.hops, quantization)
        )
        # session -> (pos, rows, drafts, a guess step's rewind position or -1)
        self.passes: dict[str, list[tuple[int, int, int, int]]] = {}
        service = self.tail_runtime.service
        handle = service.handle_step

        self.stale = 0  # guess steps the tail answered stale

        async def recorded(req, tensor):
            self.passes.setdefault(req.session_id, []).append(
                (
                    req.position,
                    tensor.shape[1],
                    req.drafts,
                    -1 if req.guess_from is None else req.guess_from,
                )
            )
            answer = await handle(req, tensor)
            self.stale += bool(answer_bytes.decode(answer.body).stale)
            return answer

        service.handle_step = recorded
        self.in_flight, self.most_in_flight = 0, 0  # replayed passes a middle hop holds at once
        for mid in self.mid_services:
            mid.handle_step = self._counted(mid.handle_step)

    def _counted(self, handle):
        async def counted(req, tensor):
            self.in_flight += bool(req.replay_pass)
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                return await handle(req, tensor)
            finally:
                self.in_flight -= bool(req.replay_pass)

        return counted


@pytest.fixture(scope="module", params=["bfloat16", "int4"])
def swarm(tiny_snapshot, request) -> Iterator[Swarm]:
    with ExitStack() as stack:
        yield Swarm(tiny_snapshot("llama"), stack, request.param)


class AlwaysDraft(DraftPolicy):
    def choose(self, acceptance, steps):
        return 2


class NeverDraft(DraftPolicy):
    def choose(self, acceptance, steps):
        return 0


def complete(swarm: Swarm, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, **GREEDY}
    resp = swarm.http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize("drafting, guessing", [(False, False), (True, False), (False, True)],
                         ids=["plain", "speculative", "guessing"])  # fmt: skip
def test_a_replay_runs_the_lost_passes_again_and_the_text_is_unchanged(
    swarm, drafting, guessing, monkeypatch
):
    generator = swarm.head.openai.generator
    if guessing:  # every third proposal's last guess is wrong: the tail finds some stale
        propose = NgramDrafter.propose

        def sometimes_wrong(drafter, k):
            out = propose(drafter, k)
            if out and len(drafter.text) % 3 == 0:
                out[-1] = 3 + (out[-1] + 1) % 190
            return out

        monkeypatch.setattr(NgramDrafter, "propose", sometimes_wrong)
    policy = generator.draft_policy
    generator.draft_policy = AlwaysDraft() if drafting else NeverDraft()
    # bfloat16: drafting is off by default (ADR-0019); the replay must be exact with it too.
    speculation = generator.speculation
    generator.speculation = SpeculationSettings("greedy", 2, 2, 4 if guessing else 0)
    prompt = [(i * 37) % 200 + 3 for i in range(300)]  # 3 wire chunks of the prompt
    try:
        swarm.hops.dead.clear()
        swarm.hops.die_after.clear()
        generator.failover.bans.lift(A)  # an earlier test's failover
        swarm.passes.clear()
        swarm.stale = 0
        calm = complete(swarm, prompt, 40)
        [calm_passes] = map(sorted, swarm.passes.values())
        swarm.passes.clear()
        swarm.hops.steps.clear()
        swarm.hops.die_after["mid-a.test"] = 15  # the prompt's 3 chunks + 11 decode passes
        again = complete(swarm, prompt, 40)
    finally:
        generator.draft_policy = policy
        generator.speculation = speculation
    assert "mid-a.test" in swarm.hops.dead, swarm.hops.steps  # the failover happened
    assert again["choices"][0]["text"] == calm["choices"][0]["text"]
    lost, replayed = map(sorted, swarm.passes.values())
    if guessing:
        # Guess steps were in flight (some stale: the tail computed nothing for those);
        # which of them left before a wrong guess was seen depends on timing, so only the
        # text is compared. The replay runs the passes that counted, as one-token steps.
        assert any(guess >= 0 for *_, guess in calm_passes + lost)
        assert swarm.stale >= 1  # some guesses were wrong: the tail computed nothing for them
        accepted = generator.service.metrics.accepted_tokens.collect()[0].samples
        assert any(s.name.endswith("_total") and s.value >= 1 for s in accepted)  # some right
        assert all(guess < 0 for *_, guess in replayed[: len(lost) - 3])
        return
    # The lost session's passes, then the fresh one's, in position order (the order each
    # hop runs them in; prompt chunks may arrive out of order). Positions only grow: a
    # pass with drafts is followed by one past the drafts the tail kept.
    assert len(lost) == 14, lost
    assert replayed[: len(lost)] == lost, (lost, replayed)  # the same passes, in order
    assert replayed == calm_passes  # and then on as the undisturbed run went
    assert any(drafts for _, _, drafts, _ in lost) == drafting
    assert max(rows for _, rows, _, _ in replayed) <= 128  # never the history as one prefill
    # Streamed back to back, not a round trip each: the middle hop held several passes at
    # once (each waiting for the one before it).
    assert swarm.most_in_flight >= 2
    replays = swarm.head.service.metrics.replay_seconds.collect()[0].samples
    assert any(s.name.endswith("_count") and s.value >= 1 for s in replays)


def test_a_silent_stream_gets_sse_comments_and_loses_nothing():
    import asyncio

    from meshnet_node.head.routes import with_keepalive

    keepalive = ": waiting\n\n"

    async def collect():
        # The source stays silent (a failover waiting for coverage, say) until the client
        # has had three keepalives: only keepalives can end its silence.
        silent_until_three = asyncio.Event()

        async def slow():
            yield "data: 1\n\n"
            await silent_until_three.wait()
            yield "data: 2\n\n"

        got = []
        async for event in with_keepalive(slow(), every_s=0.01):
            got.append(event)
            if got.count(keepalive) == 3:
                silent_until_three.set()
        return got

    async def talkative():  # never silent for a minute: no keepalive is due
        for i in range(50):
            await asyncio.sleep(0)
            yield f"data: {i}\n\n"

    async def collect_talkative():
        return [event async for event in with_keepalive(talkative(), every_s=60)]

    got = asyncio.run(asyncio.wait_for(collect(), timeout=30))
    assert got[0] == "data: 1\n\n" and got[-1] == "data: 2\n\n"  # nothing lost
    assert got[1:-1] == [keepalive] * (len(got) - 2) and len(got) >= 5  # the rest keepalives
    assert asyncio.run(collect_talkative()) == [f"data: {i}\n\n" for i in range(50)]


def test_a_client_that_leaves_with_guess_steps_in_flight_frees_every_hop(swarm):
    """The server's cancel scope cancels every await after the client left (anyio cancels
    level-triggered): the generation must still close its sessions on every hop, with the
    guess steps it had in flight cancelled, not awaited."""
    import anyio

    from meshnet_common.protocol import SamplingSpec
    from meshnet_node.head.chain import GenerationRequest

    generator = swarm.head.openai.generator
    speculation = generator.speculation
    generator.speculation = SpeculationSettings("greedy", 2, 2, 4)
    swarm.hops.dead.clear()
    swarm.hops.die_after.clear()
    generator.failover.bans.lift(A)
    stages = [swarm.head.service.stage, swarm.tail_runtime.service.stage]
    stages += [service.stage for service in swarm.mid_services]
    before = [len(stage.sessions) for stage in stages]  # a failed-over hop keeps its own
    guesses = generator.service.metrics.draft_tokens._value  # guess steps sent, so far
    sent_before, in_flight = guesses.get(), []

    async def leave_after_three_tokens():
        request = GenerationRequest(
            prompt_ids=[5, 6, 7, 8] * 8, max_tokens=200,
            sampling=SamplingSpec(temperature=0), ignore_eos=True,
        )  # fmt: skip
        with anyio.CancelScope() as scope:
            produced = 0
            async for _ in generator.generate(request, (A, TAIL)):
                produced += 1
                if produced == 3:
                    in_flight.append(guesses.get() - sent_before)
                    scope.cancel()
        with anyio.fail_after(5):
            while [len(stage.sessions) for stage in stages] != before:
                await anyio.sleep(0.02)

    try:
        swarm.http.portal.call(leave_after_three_tokens)
    finally:
        generator.speculation = speculation
    assert in_flight and in_flight[0] >= 1  # guesses had been sent when the client left
    assert [len(stage.sessions) for stage in stages] == before


def test_a_seeded_sampled_request_with_guess_steps_gives_the_text_without_them(swarm, monkeypatch):
    """With ``--speculative all`` guess steps serve sampled requests too: the tail samples
    each position once, as one step at a time would, and a stale guess samples nothing, so
    a seeded request draws the same numbers in the same order: the same text, whether the
    guesses are all wrong or mostly right."""
    seen: list[int] = []  # the longest history a proposal saw: prompt and sampled tokens

    def last_again(drafter, k):  # sampled text seldom repeats itself: all wrong, mostly
        seen[:] = max(seen, drafter.text, key=len)
        return drafter.text[-1:] * k

    def mostly_right(drafter, k):  # the tokens the first run sampled, every third one off
        n = len(drafter.text)
        return [t if (n + i) % 3 else t + 1 for i, t in enumerate(seen[n : n + k])]

    generator = swarm.head.openai.generator
    speculation = generator.speculation
    swarm.hops.dead.clear()
    swarm.hops.die_after.clear()
    generator.failover.bans.lift(A)
    body = {"model": MODEL_ID, "prompt": [5, 6, 7, 8] * 8, "max_tokens": 40, "seed": 1234,
            "temperature": 0.7, "ignore_eos": True}  # fmt: skip
    metrics = generator.service.metrics
    runs = {}
    try:
        for label, mode, propose in (("off", "off", None), ("wrong", "all", last_again),
                                     ("right", "all", mostly_right)):  # fmt: skip
            if propose is not None:
                monkeypatch.setattr(NgramDrafter, "propose", propose)
            generator.speculation = SpeculationSettings(mode, 2, 2, 4)
            swarm.stale = 0
            kept = metrics.accepted_tokens._value.get()
            resp = swarm.http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            text = resp.json()["choices"][0]["text"]
            runs[label] = (text, swarm.stale, metrics.accepted_tokens._value.get() - kept)

    finally:
        generator.speculation = speculation
    assert runs["wrong"][0] == runs["off"][0] == runs["right"][0]
    assert runs["off"][1:] == (0, 0)  # no guess steps without speculation
    assert runs["wrong"][2] == 0 and runs["right"][2] >= 10  # none right, then many
    # How many wrong guesses reach the tail (and are answered stale there) rather than
    # being dropped on the head, known wrong before they left, depends on timing; in a run
    # of this test alone, 111 and 15 of them did.


def probed_in_process(swarm) -> None:
    """bf16 only, every hop alive, and the head's prefix probes (docs/adr/0035) routed to
    the in-process hops."""
    bf16_only(swarm)
    generator = swarm.head.openai.generator
    generator.passes.prefixes.client.client = httpx.AsyncClient(transport=swarm.hops)
    swarm.hops.dead.clear()
    swarm.hops.die_after.clear()
    generator.failover.bans.lift(A)


def bf16_only(swarm) -> None:
    """int4 prompts: a pass of many rows dequantizes for a GEMM, a short one runs the packed
    kernel (ADR-0031), so a prompt's rows depend on how its chunks merged on a hop, which
    depends on timing; the texts compared below may then part at a near-tie."""
    if swarm.head.settings.quantization != Precision.BFLOAT16:
        pytest.skip("exact only where a prompt's rows do not depend on its passes (bf16)")


def test_a_session_started_after_cached_blocks_fails_over_exactly(swarm):
    """The prefix cache (docs/adr/0035): a prompt that starts after blocks its chain holds
    loses a hop mid-decode; the replay on the other replica (which holds none of them)
    computes the whole prompt, and the text is the undisturbed run's."""
    probed_in_process(swarm)
    first = [(i * 53) % 190 + 5 for i in range(300)]
    complete(swarm, first, 4)  # leaves its 2 blocks on the head, mid-a and the tail
    prompt = first + [(i * 11) % 190 + 5 for i in range(100)]
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 30, **GREEDY}
    calm = swarm.http.post("/v1/completions", json={**body, "cache_salt": "unseen"}).json()
    assert "prompt_tokens_details" not in calm["usage"]  # another salt: nothing cached
    swarm.hops.steps.clear()
    swarm.hops.die_after["mid-a.test"] = 8  # the prompt's 2 chunks after the blocks + 6 passes
    again = swarm.http.post("/v1/completions", json=body).json()
    assert "mid-a.test" in swarm.hops.dead, swarm.hops.steps  # the failover happened
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}
    assert again["choices"][0]["text"] == calm["choices"][0]["text"]


def test_a_request_scoring_its_prompt_computes_it_all(swarm):
    """``echo`` with ``logprobs`` needs every prompt row: no cached block is used."""
    probed_in_process(swarm)
    prompt = [(i * 29) % 190 + 5 for i in range(300)]
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 2, **GREEDY}
    swarm.http.post("/v1/completions", json=body)  # leaves its blocks
    cached = swarm.http.post("/v1/completions", json=body).json()
    assert cached["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}
    scored = [swarm.http.post("/v1/completions", json={**body, "echo": True, "logprobs": 0})
              .json() for _ in range(2)]  # fmt: skip
    for answer in scored:
        assert "prompt_tokens_details" not in answer["usage"]
        assert len(answer["choices"][0]["logprobs"]["token_logprobs"]) == 302
    assert scored[0]["choices"][0]["logprobs"] == scored[1]["choices"][0]["logprobs"]
