"""The prefix cache (docs/adr/0035) on SmolLM2 bf16 over 3 processes (a tracker node and two
nodes), against prompts never seen, measured back to back in the same swarm:

- chat: four turns after a ~2k-token system prompt; each turn's prompt is the one before
  plus an answer and a new message. TTFT of each turn against the same prompt under a
  ``cache_salt`` never used (so nothing cached applies), and the share of the prompt that
  was computed (``1 - cached_tokens / prompt_tokens``);
- agents: N requests sharing the system prompt, each with its own question: TTFT of the
  agents after the first against an unseen prompt of the same length;
- long prompt: the token gaps of two running streams while a 4k-token prompt arrives,
  against the same streams alone (prompts are not yet interleaved with decode steps: this
  shows the stall that is left).

    .venv/bin/python bench/prefix_bench.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from pathlib import Path

import httpx
from benchlib import write_json
from swarm import Swarm, completion_body, stream_arrivals

from meshnet_common.models.gguf_import import SMOLLM2_MODEL_ID, import_smollm2
from meshnet_common.tiny.snapshots import CORPUS

RANGES = [(0, 10), (10, 20), (20, 30)]
SYSTEM_TOKENS = 2048


def corpus(tokenizer, length: int, offset: int = 0) -> list[int]:
    ids = tokenizer(CORPUS).input_ids
    ids = ids[offset % len(ids) :] + ids * (length // len(ids) + 2)
    return ids[:length]


def first_chunk(client: httpx.Client, url: str, prompt: list[int], **extra) -> tuple[float, int]:
    """(ms to the first streamed chunk, cached prompt tokens) of a 1-token completion."""
    body = completion_body(SMOLLM2_MODEL_ID, prompt, 1, stream=True,
                           stream_options={"include_usage": True}, **extra)  # fmt: skip
    t0, first, cached = time.perf_counter(), None, 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code >= 400:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            if first is None:
                first = (time.perf_counter() - t0) * 1000
            if '"usage"' in line and '"cached_tokens"' in line:
                cached = int(line.split('"cached_tokens":')[1].split("}")[0])
    return first, cached


def unseen(client: httpx.Client, url: str, prompt: list[int]) -> float:
    return first_chunk(client, url, prompt, cache_salt=f"unseen-{uuid.uuid4().hex}")[0]


def chat_turns(client, url: str, tokenizer, turns: int) -> list[dict]:
    prompt = corpus(tokenizer, SYSTEM_TOKENS)
    rows = []
    for turn in range(1, turns + 1):
        if turn > 1:  # the answer before and a new message
            prompt = prompt + corpus(tokenizer, 96, offset=turn * 131)
        cached_ms, cached = first_chunk(client, url, prompt)
        fresh_ms = unseen(client, url, prompt)
        rows.append({"turn": turn, "prompt_tokens": len(prompt), "cached_tokens": cached,
                     "ttft_ms": cached_ms, "unseen_ms": fresh_ms,
                     "ratio": cached_ms / fresh_ms,
                     "computed_share": 1 - cached / len(prompt)})  # fmt: skip
    return rows


def agents(client, url: str, tokenizer, count: int) -> dict:
    system = corpus(tokenizer, SYSTEM_TOKENS, offset=7)
    shared, fresh = [], []
    for agent in range(count):
        prompt = system + corpus(tokenizer, 64, offset=1000 + agent * 67)
        ms, cached = first_chunk(client, url, prompt)
        if agent:
            shared.append(ms)
            fresh.append(unseen(client, url, prompt))
    return {"agents": count, "shared_ms": statistics.median(shared),
            "unseen_ms": statistics.median(fresh),
            "ratio": statistics.median(s / f for s, f in zip(shared, fresh, strict=True))}  # fmt: skip


async def _gaps(url: str, prompts: list[list[int]], tokens: int, long: list[int] | None) -> list:
    async with httpx.AsyncClient(timeout=600) as client:
        streams = [asyncio.ensure_future(stream_arrivals(client, url, SMOLLM2_MODEL_ID, p, tokens))
                   for p in prompts]  # fmt: skip
        if long is not None:
            await asyncio.sleep(1.0)  # the streams are decoding
            body = completion_body(SMOLLM2_MODEL_ID, long, 1, cache_salt=uuid.uuid4().hex)
            await client.post(f"{url}/v1/completions", json=body)
        done = await asyncio.gather(*streams)
    return [b - a for _, arrivals in done for a, b in zip(arrivals, arrivals[1:], strict=False)]


def long_prompt(url: str, tokenizer, tokens: int) -> dict:
    prompts = [corpus(tokenizer, 32, offset=50 * i) for i in range(2)]
    alone = asyncio.run(_gaps(url, prompts, tokens, None))
    during = asyncio.run(_gaps(url, prompts, tokens, corpus(tokenizer, 4096, offset=3)))

    def p99(gaps):
        return sorted(gaps)[int(0.99 * (len(gaps) - 1))] * 1000

    return {"alone_p99_ms": p99(alone), "during_p99_ms": p99(during),
            "during_max_ms": max(during) * 1000}  # fmt: skip


def run(models_dir: Path, threads: int, quick: bool) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models_dir / SMOLLM2_MODEL_ID)
    # The cache is opt-in (ADR-0054): every process of this section turns it on.
    extra = {i: ["--prefix-cache"] for i in range(len(RANGES))}
    swarm = Swarm(models_dir, SMOLLM2_MODEL_ID, RANGES, threads, extra=extra)
    try:
        swarm.start()
        swarm.wait_ready()
        url = swarm.tracker_url
        with httpx.Client(timeout=600) as client:
            first_chunk(client, url, corpus(tokenizer, 300, offset=11))  # warm every hop
            results = {"chat": chat_turns(client, url, tokenizer, 4),
                       "agents": agents(client, url, tokenizer, 3 if quick else 5)}  # fmt: skip
        results["long_prompt"] = long_prompt(url, tokenizer, 48 if quick else 96)
    finally:
        swarm.stop()
    return results


def print_prefix(res: dict) -> None:
    print("\nprefix cache — SmolLM2 bf16, 3 processes (TTFT against the same prompt unseen)")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT ms':>8} {'unseen ms':>9} "
          f"{'ratio':>6} {'computed':>8}")  # fmt: skip
    for row in res["chat"]:
        print(f"{row['turn']:>4} {row['prompt_tokens']:>7} {row['cached_tokens']:>7} "
              f"{row['ttft_ms']:>8.0f} {row['unseen_ms']:>9.0f} {row['ratio']:>6.2f} "
              f"{row['computed_share']:>8.0%}")  # fmt: skip
    a = res["agents"]
    print(
        f"agents sharing a {SYSTEM_TOKENS}-token system prompt ({a['agents']}): TTFT "
        f"{a['shared_ms']:.0f} ms vs unseen {a['unseen_ms']:.0f} ms (ratio {a['ratio']:.2f})"
    )
    lp = res["long_prompt"]
    print(
        f"token gaps of 2 streams, p99: alone {lp['alone_p99_ms']:.0f} ms; while a 4096-token "
        f"prompt arrives {lp['during_p99_ms']:.0f} ms (max {lp['during_max_ms']:.0f} ms)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    import_smollm2(args.models_dir)
    res = run(args.models_dir, args.threads, args.quick)
    print_prefix(res)
    write_json("prefix.json", res)


if __name__ == "__main__":
    main()
