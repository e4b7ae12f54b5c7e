"""The prefix cache in a real swarm (docs/adr/0035): a multi-turn chat over three processes
reuses, on every hop, the blocks of the turns before; the answers are those of a prompt
never seen (another ``cache_salt``, which shares nothing)."""

from __future__ import annotations

import httpx
import pytest
from swarm_harness import Swarm, covered, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SYSTEM = "You are a careful assistant. " + " ".join(
    f"Rule {i}: when asked about item {i}, answer with its number and one short sentence."
    for i in range(40)
)


@pytest.fixture(scope="module")
def tracker(smollm2_snapshot, models_dir, tmp_path_factory):
    swarm = Swarm(models_dir, tmp_path_factory.mktemp("prefix-logs"), heartbeat_s=0.5)
    try:
        tracker = swarm.tracker(
            "--model-id", MODEL, "--shard-start", "0", "--shard-end", "10", "--prefix-cache"
        )
        swarm.node(tracker, MODEL, 10, 20, "--prefix-cache")
        swarm.node(tracker, MODEL, 20, 30, "--prefix-cache")
        for proc in swarm.procs:
            proc.wait_healthy()
        wait_for(lambda: covered(tracker, MODEL), timeout=60)
        yield tracker, swarm.procs
    finally:
        swarm.close()


def chat(tracker, messages: list[dict], **extra) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, **extra}
    resp = httpx.post(f"{tracker.url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def cached_of(answer: dict) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_a_multi_turn_chat_reuses_the_turns_before_on_every_hop(tracker):
    tracker, procs = tracker
    messages = [{"role": "system", "content": SYSTEM}]
    before = 0  # the prompt tokens of the turn before
    for turn in range(4):
        messages.append({"role": "user", "content": f"Tell me about item {turn * 7 + 3}."})
        answer = chat(tracker, messages)
        prompt = answer["usage"]["prompt_tokens"]
        # The turn before left its prompt's full blocks on every hop; this prompt starts
        # with that one (its answer and the new message follow).
        assert cached_of(answer) == before // 128 * 128, (turn, answer["usage"])
        before = prompt
        messages.append(
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
        )
    assert before > 600
    last = messages[:-1]
    unseen = chat(tracker, last, cache_salt="never-seen")
    assert cached_of(unseen) == 0  # another salt shares no block
    again = chat(tracker, last)
    assert cached_of(again) > 0
    assert again["choices"][0]["message"] == unseen["choices"][0]["message"]
    assert again["choices"][0]["message"]["content"] == messages[-1]["content"]
    for proc in procs:  # every hop counted its hits
        metrics = httpx.get(f"{proc.url}/metrics", timeout=10).text
        hits = next(line for line in metrics.splitlines()
                    if line.startswith("meshnet_prefix_cache_hits_total"))  # fmt: skip
        assert float(hits.split()[-1]) >= 4, hits
