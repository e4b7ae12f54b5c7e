"""Exact under every schedule (ADR-0038), at real shapes: SmolLM2 split over three real
processes computing with torch's default threads, six greedy prompts asked twice while
eight other streams decode, every text equal to one HF process and to each other, in
bfloat16. Tiny models alone do not exercise the kernels real shapes pick."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "The best way to learn a new language is",
    "Water boils at a temperature of",
]
TOKENS = 32
STREAMS = 8


@pytest.fixture(scope="module")
def swarm(smollm2_snapshot, models_dir, tmp_path_factory):
    from swarm_harness import Swarm, covered, wait_for

    threads = str(torch.get_num_threads())  # torch's default, as a user's nodes compute
    swarm = Swarm(models_dir, tmp_path_factory.mktemp("determinism-logs"), heartbeat_s=0.5)
    try:
        tracker = swarm.tracker(
            "--model-id", MODEL, "--shard-start", "0", "--shard-end", "10", "--threads", threads
        )
        swarm.node(tracker, MODEL, 10, 20, "--threads", threads)
        swarm.node(tracker, MODEL, 20, 30, "--threads", threads)
        for proc in swarm.procs:
            proc.wait_healthy()
        wait_for(lambda: covered(tracker, MODEL), timeout=90)
        yield tracker
    finally:
        swarm.close()


@pytest.fixture(scope="module")
def reference(smollm2_snapshot) -> dict[str, str]:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_snapshot)
    model = AutoModelForCausalLM.from_pretrained(smollm2_snapshot, dtype=torch.bfloat16).eval()
    texts = {}
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt).input_ids])
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=TOKENS, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        texts[prompt] = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return texts


def _complete(tracker, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    resp = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def test_six_prompts_twice_under_eight_streams_equal_hf_and_each_other(reference, swarm):
    alone = {prompt: _complete(swarm, prompt) for prompt in PROMPTS}  # nothing else running
    assert alone == reference

    loaded: list[tuple[str, str]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def stream(i: int) -> None:
        try:
            for prompt in PROMPTS[i % 6 :] + PROMPTS[: i % 6]:
                text = _complete(swarm, prompt)
                with lock:
                    loaded.append((prompt, text))
        except BaseException as exc:  # raised in the test below
            errors.append(exc)

    workers = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, errors[0]
    assert len(loaded) == STREAMS * len(PROMPTS)
    wrong = [(prompt, text) for prompt, text in loaded if text != reference[prompt]]
    assert not wrong, f"{len(wrong)} of {len(loaded)} differ, e.g. {wrong[0]}"
