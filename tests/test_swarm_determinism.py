"""Exact under every schedule (ADR-0038), at real shapes: SmolLM2 split over three real
processes computing with torch's default threads, six greedy prompts asked twice while
eight other streams decode, every text equal to one HF process and to each other, in
bfloat16; prompts of several wire chunks scored and continued as HF's one forward does
(ADR-0053). Tiny models alone do not exercise the kernels real shapes pick."""

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


def _corpus_ids(smollm2_snapshot, offset: int, length: int) -> list[int]:
    from meshnet_common.tiny.snapshots import CORPUS

    ids = AutoTokenizer.from_pretrained(smollm2_snapshot)(CORPUS * 8).input_ids
    return ids[offset : offset + length]


@pytest.fixture(scope="module")
def bf16_model(smollm2_snapshot):
    return AutoModelForCausalLM.from_pretrained(smollm2_snapshot, dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("length", [300, 700])
def test_long_prompts_score_as_hfs_one_forward(swarm, smollm2_snapshot, bf16_model, length):
    """Echoed log-probs of a prompt of 3 and 6 wire chunks equal, bit for bit at default
    flags, HF's one forward of the prompt but its last token: what lm-evaluation-harness's
    HF backend computes for the log-likelihoods it asks meshnet for (ADR-0053)."""
    prompt = _corpus_ids(smollm2_snapshot, 7, length)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1,
            "temperature": 0}  # fmt: skip
    resp = httpx.post(f"{swarm.url}/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    got = resp.json()["choices"][0]["logprobs"]["token_logprobs"][1:length]
    with torch.inference_mode():
        logits = bf16_model(torch.tensor([prompt[:-1]])).logits[0].float()
    rows = torch.log_softmax(logits, -1)[torch.arange(length - 1), torch.tensor(prompt[1:])]
    assert got == rows.tolist()


def test_a_long_prompt_continues_as_hf_generate(swarm, smollm2_snapshot, bf16_model):
    """A 400-token prompt (four wire chunks) never seen before: the greedy text and its
    log-probs equal HF's ``generate`` in bfloat16, at default flags."""
    _assert_generates_as_hf(swarm, smollm2_snapshot, bf16_model,
                            _corpus_ids(smollm2_snapshot, 501, 400))  # fmt: skip


def test_prompts_sharing_a_long_prefix_each_continue_as_hf_generate(
    swarm, smollm2_snapshot, bf16_model
):
    """Few-shot generations (lm-evaluation-harness's) share hundreds of tokens of prompt:
    one after another, each equals HF's ``generate`` of it alone. At default flags nothing
    of the first is reused for the second (the prefix cache is opt-in, ADR-0054)."""
    shared = _corpus_ids(smollm2_snapshot, 900, 300)
    for offset in (1300, 1500):
        prompt = shared + _corpus_ids(smollm2_snapshot, offset, 40)
        _assert_generates_as_hf(swarm, smollm2_snapshot, bf16_model, prompt)


def _assert_generates_as_hf(swarm, smollm2_snapshot, bf16_model, prompt: list[int]) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 1}  # fmt: skip
    resp = httpx.post(f"{swarm.url}/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert "prompt_tokens_details" not in resp.json()["usage"]  # no cached tokens
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = bf16_model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=TOKENS,
            eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :]
    want = [
        float(torch.log_softmax(s[0].float(), -1)[t])
        for s, t in zip(out.scores, tokens, strict=True)
    ]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_snapshot)
    assert choice["text"] == tokenizer.decode(tokens, skip_special_tokens=True)
    assert choice["logprobs"]["token_logprobs"] == want
