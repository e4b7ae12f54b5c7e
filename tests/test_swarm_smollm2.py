"""A real swarm on SmolLM2: tracker node + two nodes as separate processes on loopback.

Greedy output must equal single-process HF on the same snapshot and precision.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from baselines import hf_chunked_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colors are"]


@pytest.fixture(scope="module")
def smol(smollm2_snapshot, models_dir, tmp_path_factory):
    from swarm_harness import Swarm, covered, wait_for

    swarm = Swarm(models_dir, tmp_path_factory.mktemp("smol-logs"), heartbeat_s=0.5)
    try:
        tracker = swarm.tracker("--model-id", MODEL, "--shard-start", "0", "--shard-end", "10")
        swarm.node(tracker, MODEL, 10, 20)
        swarm.node(tracker, MODEL, 20, 30)
        for proc in swarm.procs:
            proc.wait_healthy()
        wait_for(lambda: covered(tracker, MODEL), timeout=60)
        yield tracker
    finally:
        swarm.close()


@pytest.fixture(scope="module")
def hf(smollm2_snapshot):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_snapshot)
    model = AutoModelForCausalLM.from_pretrained(smollm2_snapshot, dtype=torch.bfloat16).eval()
    return tokenizer, model


def hf_greedy(hf, ids: list[int], n: int) -> str:
    tokenizer, model = hf
    tokens, _ = hf_chunked_greedy(model, ids, n)
    eos = tokenizer.eos_token_id
    if eos in tokens:
        tokens = tokens[: tokens.index(eos) + 1]
    return tokenizer.decode(tokens, skip_special_tokens=True)


def complete(tracker, **body) -> httpx.Response:
    return httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=120)


def test_greedy_completions_equal_single_process(smol, hf):
    tokenizer, model = hf
    for prompt in PROMPTS:
        resp = complete(smol, model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert resp.status_code == 200, resp.text
        text = resp.json()["choices"][0]["text"]
        ids = tokenizer(prompt).input_ids
        assert text == hf_greedy(hf, ids, 24), prompt
        generated = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=24,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )  # fmt: skip
        assert text == tokenizer.decode(generated[0, len(ids) :], skip_special_tokens=True)
    paris = complete(smol, model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert paris.json()["choices"][0]["text"].startswith(" Paris")


def test_long_prompt_is_chunked_and_matches(smol, hf):
    tokenizer, _ = hf
    prompt = " ".join(f"item {i}," for i in range(120))  # > 128 tokens: several chunks
    ids = tokenizer(prompt).input_ids
    assert len(ids) > 300
    resp = complete(smol, model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    body = resp.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["text"] == hf_greedy(hf, ids, 12)


def test_openai_client_completions_chat_and_streaming(smol, hf):
    openai = pytest.importorskip("openai")
    tokenizer, _ = hf
    client = openai.OpenAI(base_url=f"{smol.url}/v1", api_key="unused", max_retries=0)
    assert MODEL in [m.id for m in client.models.list().data]

    done = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True
        )
    )
    assert streamed == done.choices[0].text
    assert done.usage.completion_tokens == 16

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0
    )
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert chat.choices[0].message.content == hf_greedy(hf, list(ids), 20)
    assert "Paris" in chat.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_sampling_options(smol):
    seeded = [
        complete(smol, model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.9,
                 top_p=0.9, seed=123).json()["choices"][0]["text"]
        for _ in range(2)
    ]  # fmt: skip
    assert seeded[0] == seeded[1]
    body = complete(smol, model=MODEL, prompt=["One", "Two"], n=2, max_tokens=4, temperature=0)
    assert len(body.json()["choices"]) == 4
    stopped = complete(
        smol, model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=["."]
    )
    choice = stopped.json()["choices"][0]
    assert "." not in choice["text"] and choice["finish_reason"] == "stop"
    fixed = complete(smol, model=MODEL, prompt="Hi", max_tokens=30, temperature=0, ignore_eos=True)
    assert fixed.json()["usage"]["completion_tokens"] == 30
    lp = complete(smol, model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=2)
    logprobs = lp.json()["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == 3 and len(logprobs["top_logprobs"][0]) == 2


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope/nope", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 10**7}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "temperature": 9}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
        ({"model": MODEL}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(smol, body, status, param):
    resp = complete(smol, **body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"]


def test_nan_and_garbage_bodies(smol):
    nan = httpx.post(
        f"{smol.url}/v1/completions",
        content=b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL.encode(),
        headers={"content-type": "application/json"},
    )
    assert nan.status_code == 400 and nan.json()["error"]["param"] == "temperature"
    garbage = httpx.post(f"{smol.url}/v1/completions", content=b"{not json")
    assert garbage.status_code == 400
    extra = complete(smol, model=MODEL, prompt="Hi", max_tokens=2, frobnicate=True)
    assert extra.status_code == 400  # an unknown field is refused, never silently ignored
    assert extra.json()["error"]["param"] == "frobnicate"


def test_stream_ends_with_done(smol):
    with httpx.stream(
        "POST", f"{smol.url}/v1/completions", timeout=60,
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True},
    ) as resp:  # fmt: skip
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert all("choices" in json.loads(line[6:]) for line in lines[:-1])
