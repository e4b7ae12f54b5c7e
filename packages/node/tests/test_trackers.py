"""A node given several trackers (``--tracker URL1,URL2``) talks to the current one and moves
to the next when it does not answer (refused, timed out, 5xx), round robin; a 4xx is an
answer and stays where it is. Registration, heartbeats, leaving, routes and the start-up
wait follow it; a tracker that does not know the node makes it register there, and the
tracker key kept from the first stays good on the others (one key per swarm). Nothing here
sleeps for real: the fake trackers are in-memory HTTP."""

from __future__ import annotations

import asyncio
import logging
import re
import secrets

import httpx
import pytest

from meshnet_common.errors import ModelNotCovered
from meshnet_common.protocol import (
    Heartbeat,
    HeartbeatResponse,
    NodeAnnouncement,
    RegisterResponse,
    ShardSpec,
)
from meshnet_common.trust.identity import issue
from meshnet_common.trust.manifest_keys import ManifestSigner
from meshnet_node.cli import build_parser as node_parser
from meshnet_node.retry import RetryPolicy
from meshnet_node.settings import NodeSettings
from meshnet_node.swarm.joining import wait_for_tracker
from meshnet_node.swarm.membership import Membership, TrackerClient
from meshnet_node.swarm.trackers import Trackers

T1, T2, T3 = "http://t1.test", "http://t2.test", "http://t3.test"


class Calls:
    """A scripted ``call(url)``: each tracker answers with a status, or raises (down)."""

    def __init__(self, **answers: int | type[Exception]) -> None:
        self.answers = {f"http://{name}.test": a for name, a in answers.items()}
        self.asked: list[str] = []

    def __call__(self, url: str) -> httpx.Response:
        self.asked.append(url)
        answer = self.answers[url]
        if isinstance(answer, int):
            return httpx.Response(answer, request=httpx.Request("GET", url))
        raise answer("no answer", request=httpx.Request("GET", url))


# -- the tracker list ------------------------------------------------------------------------


def test_a_tracker_that_does_not_answer_makes_the_next_one_current():
    trackers = Trackers([T1, T2, T3])
    calls = Calls(t1=httpx.ConnectError, t2=httpx.ReadTimeout, t3=200)
    assert trackers.send(calls).status_code == 200
    assert calls.asked == [T1, T2, T3] and trackers.current == T3
    calls.asked.clear()
    trackers.send(calls)  # it stays with the one that answered: no flapping back
    assert calls.asked == [T3]
    calls.answers.update({T3: 502, T1: 200})  # round robin: after the last, the first
    assert trackers.send(calls).status_code == 200
    assert calls.asked == [T3, T3, T1] and trackers.current == T1


def test_a_4xx_is_an_answer_and_a_listed_5xx_too():
    trackers = Trackers([T1, T2])
    calls = Calls(t1=401, t2=200)
    assert trackers.send(calls).status_code == 401  # the swarm's word: not asked elsewhere
    assert calls.asked == [T1] and trackers.current == T1
    calls.answers[T1] = 503
    assert trackers.send(calls, answers=frozenset({503})).status_code == 503  # "no chain now"
    assert calls.asked == [T1, T1] and trackers.current == T1
    assert trackers.send(calls).status_code == 200  # otherwise a 5xx is no answer
    assert trackers.current == T2


def test_all_down_ends_with_the_last_failure_after_the_retries(caplog):
    sleeps: list[float] = []
    retry = RetryPolicy(max_attempts=3, backoff_base_s=0.5, backoff_cap_s=0.75)
    trackers = Trackers([T1, T2])
    calls = Calls(t1=httpx.ConnectError, t2=httpx.ConnectTimeout)
    with caplog.at_level(logging.WARNING), pytest.raises(httpx.ConnectTimeout):
        trackers.send(calls, retry=retry, sleep=sleeps.append)
    assert calls.asked == [T1, T2] * 3 and sleeps == [0.5, 0.75]  # 3 rounds, capped backoff
    assert len(caplog.records) == 2  # each tracker's failure said once, not every round
    calls = Calls(t1=httpx.ConnectError, t2=500)
    assert trackers.send(calls).status_code == 500  # the last 5xx, for the caller to read
    with pytest.raises(httpx.ConnectError):
        Trackers([T1]).send(Calls(t1=httpx.ConnectError))  # one tracker: one try, as before


def test_the_async_client_fails_over_the_same_way():
    trackers = Trackers([T1, T2])
    calls = Calls(t1=httpx.ConnectError, t2=200)

    async def call(url: str) -> httpx.Response:
        return calls(url)

    assert asyncio.run(trackers.asend(call)).status_code == 200
    assert calls.asked == [T1, T2] and trackers.current == T2


def test_a_failure_already_moved_past_does_not_skip_a_tracker():
    trackers = Trackers([T1, T2, T3])
    assert trackers.failed(T1) == T2
    assert trackers.failed(T1) == T2  # another thread's late word on T1: T2 stays current
    assert trackers.in_order() == (T2, T3, T1)


def test_the_tracker_flag_takes_a_list_and_checks_each_url():
    settings = NodeSettings.exactly(tracker_url=f" {T1}/ ,{T2}")
    assert settings.tracker_urls == (T1, T2) and settings.tracker_url == f"{T1},{T2}"
    assert NodeSettings.exactly(tracker_url=T1).tracker_urls == (T1,)  # one, as before
    assert NodeSettings.exactly(tracker_url=[T1, T2]).tracker_urls == (T1, T2)  # a file's list
    for bad, said in ((f"{T1},t2.test:80", "expected http(s)://HOST[:PORT]"),
                      (f"{T1},{T1}/", "given twice"), ("http://t1.test:99999", "HOST[:PORT]"),
                      ("http://t1.test?x=1", "no query")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(said)):
            NodeSettings.exactly(tracker_url=bad)
    with pytest.raises(ValueError) as refused:  # the CLI's one line names the flag and env
        NodeSettings.from_args(node_parser().parse_args(["--tracker", f"{T1},{T2}/v1?x"]))
    assert str(refused.value).startswith("--tracker [env MESHNET_TRACKER]: ")
    assert "\n" not in str(refused.value)


def test_waiting_at_start_returns_once_any_tracker_answers():
    trackers = Trackers([T1, T2])
    calls = Calls(t1=httpx.ConnectError, t2=503)  # up, still loading: it answers HTTP

    wait_for_tracker(trackers, 5.0, sleep=pytest.fail, get=lambda url, **_: calls(url[:-7]))
    assert trackers.current == T2
    down = Calls(t1=httpx.ConnectError, t2=httpx.ConnectError)
    now = iter(range(100))
    with pytest.raises(OSError, match="trackers http://t1.test, http://t2.test unreachable"):
        wait_for_tracker([T1, T2], 3.0, clock=lambda: next(now), sleep=lambda s: None,
                         get=lambda url, **_: down(url[:-7]))  # fmt: skip


# -- membership over two trackers ----------------------------------------------------------


class FakeTracker:
    """An in-memory tracker (one of a swarm's: its ``signer`` may be the swarm's key): it
    registers nodes, issues their secrets and certificates, answers heartbeats."""

    def __init__(self, signer: ManifestSigner) -> None:
        self.signer = signer
        self.secrets: dict[str, str] = {}
        self.up = True
        self.registrations: list[str | None] = []  # the secret each one presented

    def handle(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            raise httpx.ConnectError("refused", request=request)
        proof = request.headers.get("x-meshnet-node-secret")
        if request.url.path == "/v1/nodes/register":
            ann = NodeAnnouncement.model_validate_json(request.content)
            self.registrations.append(proof)
            secret = self.secrets.setdefault(ann.node_id, secrets.token_hex(8))
            reply = RegisterResponse(
                node_id=ann.node_id, heartbeat_interval_s=1.0, url=ann.url, node_secret=secret,
                certificate=issue(self.signer, ann.node_id, ann.public_key),
                tracker_key=self.signer.public().text,
            )  # fmt: skip
            return httpx.Response(200, content=reply.model_dump_json())
        if request.url.path == "/v1/nodes/heartbeat":
            beat = Heartbeat.model_validate_json(request.content)
            known = beat.node_id in self.secrets
            if known and proof != self.secrets[beat.node_id]:
                error = {"error": {"message": "who?", "type": "x", "code": "node_unauthenticated"}}
                return httpx.Response(401, json=error)
            return httpx.Response(200, content=HeartbeatResponse(known=known).model_dump_json())
        if request.method == "DELETE":
            return httpx.Response(200 if self.secrets.pop("n1", None) else 404, json={})
        return httpx.Response(404, json={})


def _swarm(*trackers: FakeTracker) -> httpx.Client:
    by_host = {f"t{n}.test": t for n, t in enumerate(trackers, 1)}
    return httpx.Client(transport=httpx.MockTransport(lambda r: by_host[r.url.host].handle(r)))


def _membership() -> Membership:
    announcement = NodeAnnouncement(
        node_id="n1", url="http://10.0.0.7:9000", num_layers=2, quantization="bfloat16",
        shard=ShardSpec(model_id="org/model", shard_start=0, shard_end=2), device="cpu",
        memory_declared_bytes=1, memory_free_bytes=1,
    )  # fmt: skip
    beat = Heartbeat(node_id="n1", state="serving", active_sessions=0, kv_tokens=0,
                     memory_free_bytes=1)  # fmt: skip
    return Membership(f"{T1},{T2}", lambda: announcement, lambda: beat, 1.0)


def test_a_node_whose_tracker_dies_registers_with_the_next_one(caplog):
    key = ManifestSigner.generate()  # the swarm's one key, given to both trackers
    first, second = FakeTracker(key), FakeTracker(key)
    member = _membership()
    member._client = _swarm(first, second)
    member.register_once()
    assert first.registrations == [None] and member.secret == first.secrets["n1"]
    assert member.beat().known
    first.up = False  # killed: its heartbeats go to the second, which never saw the node
    with caplog.at_level(logging.WARNING):
        assert member.beat().known is False  # -> the membership thread registers again
    assert member.trackers.current == T2
    assert any("tracker http://t1.test did not answer" in r.getMessage() for r in caplog.records)
    member.register_once()  # with the tracker now current, the old secret presented
    assert second.registrations == [first.secrets["n1"]]
    assert member.secret == second.secrets["n1"] and member.beat().known
    assert member.peers.tracker_key == key.public()  # the same key: kept, and good on both
    first.up = True  # back: the node stays where it is
    assert member.beat().known and first.registrations == [None]
    member.leave("n1")
    assert "n1" not in second.secrets
    member._client.close()


def test_a_heartbeat_refused_with_401_makes_the_node_register_again():
    key = ManifestSigner.generate()
    first, second = FakeTracker(key), FakeTracker(key)
    second.secrets["n1"] = "someone-elses"  # it holds the id under another secret
    member = _membership()
    member._client = _swarm(first, second)
    member.register_once()
    first.up = False
    assert member.beat() == HeartbeatResponse(known=False)
    member._client.close()


def test_a_tracker_with_another_key_is_not_believed(caplog):
    first, second = FakeTracker(ManifestSigner.generate()), FakeTracker(ManifestSigner.generate())
    member = _membership()
    member._client = _swarm(first, second)
    member.register_once()
    first.up = False
    with caplog.at_level(logging.ERROR, logger="meshnet_node.swarm.membership"):
        member.register_once()
    assert member.peers.tracker_key == first.signer.public()  # the first key stays
    [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert second.signer.public().text in error and T2 in error
    member._client.close()


def test_routes_fail_over_and_a_503_is_the_trackers_answer():
    asked: list[str] = []

    def swarm(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        if request.url.host == "t1.test":
            raise httpx.ConnectError("refused", request=request)
        error = {"error": {"message": "no chain", "type": "x", "code": "model_not_covered"}}
        return httpx.Response(503, json=error)

    async def route() -> None:
        client = TrackerClient(f"{T1},{T2}")
        client.client = httpx.AsyncClient(transport=httpx.MockTransport(swarm))
        with pytest.raises(ModelNotCovered):
            await client.route("org/model", "n1")
        with pytest.raises(ModelNotCovered):
            await client.route("org/model", "n1")
        await client.aclose()

    asyncio.run(route())
    assert asked == ["t1.test", "t2.test", "t2.test"]  # the 503 was not taken elsewhere
