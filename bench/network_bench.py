"""Decode over emulated links: SmolLM2 on a tracker node + 2 nodes, a delay relay in front
of every process (``link_relay.py``), one-way delays 0 / 5 / 25 ms and a 100 Mbit/s link.

For each delay it reports greedy decode tokens/s on a code-completion prompt against the
one-traversal-per-token bound ``1 / (undelayed step time + 2 x hops x delay)`` (the ceiling
when every token waits for a whole round trip of the chain; the step time is the plain
variant's), for four variants: ``plain`` (no speculation, answers back through the chain:
the data path before issue #17), ``direct`` (the tail answers the head directly),
``direct+drafts`` (drafts verified in one pass per step, ``--guess-steps 0``) and
``direct+spec`` (the defaults: direct answers over slow links and guess steps in flight,
exact in bfloat16 too, ADR-0019). Also tokens per traversal (for guess steps: per step
whose answer was waited for from the start), whether the text equals the plain undelayed
run's, and TTFT of a 2048-token prompt at 100 Mbit/s against the time its activations take
on such links.

    .venv/bin/python bench/network_bench.py [--quick] [--delays 0,5,25] [--variants plain,direct,direct+spec]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
from benchlib import REPO_ROOT, write_json
from link_relay import set_links
from swarm import Swarm, complete, free_port, ttft_ms

from meshnet_common.models.gguf_import import SMOLLM2_MODEL_ID, import_smollm2

RANGES = [(0, 10), (10, 20), (20, 30)]
HOPS = 2  # network hops after the head (the tracker node)
# After the links change: nodes probe their links every half heartbeat and pack frames by
# what the last two probes measured (raw on fast links, zstd on slow ones: ADR-0057).
LINK_SETTLE_S = 3.0
CODE_PROMPT = '''def mean(values):
    """The arithmetic mean of a list of numbers."""
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    """The variance of a list of numbers."""
'''


VARIANTS = (  # (label, node flags): today's data path first, it sets the bound
    ("plain", ["--speculative", "off", "--no-direct-answers"]),
    ("direct", ["--speculative", "off"]),
    ("direct+drafts", ["--guess-steps", "0"]),  # drafts verified in one pass per step
    ("direct+spec", []),  # the defaults: guess steps in flight (ADR-0019)
)


@contextlib.contextmanager
def relayed_swarm(models_dir: Path, threads: int, flags: list[str]):
    """The swarm with a relay in front of each process (the tracker node too, which tails
    answer directly); yields (swarm, control port)."""
    ports = [free_port() for _ in RANGES]
    fronts = [free_port() for _ in RANGES]
    control = free_port()
    pairs = [f"{f}={p}" for f, p in zip(fronts, ports, strict=True)]
    relay = subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "bench" / "link_relay.py"), "--control", str(control),
         *pairs], stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    relay.stdout.readline()  # "relays ready"
    extra = {i: ["--advertise-url", f"http://127.0.0.1:{fronts[i]}", *flags]
             for i in range(len(RANGES))}  # fmt: skip
    swarm = Swarm(models_dir, SMOLLM2_MODEL_ID, RANGES, threads, ports=ports, extra=extra)
    try:
        swarm.start()
        swarm.wait_ready()
        yield swarm, control
    finally:
        swarm.stop()
        relay.terminate()
        relay.wait()


def decode_run(url: str, prompt: list[int], tokens: int) -> dict:
    with httpx.Client(timeout=600) as client:
        complete(client, url, SMOLLM2_MODEL_ID, prompt[:16], 4)  # warm
        out = complete(client, url, SMOLLM2_MODEL_ID, prompt, tokens)
    timing = out["response"].get("meshnet_timing") or {}
    steps = timing.get("decode_steps") or tokens - 1
    return {
        "tok_s": tokens / out["wall_s"],
        "wall_s": out["wall_s"],
        "tokens_per_traversal": (tokens - 1) / max(steps, 1),
        "text": out["text"],
    }


def run(models_dir: Path, delays: list[float], tokens: int, threads: int, repeat: int,
        variants: tuple[str, ...] = tuple(v for v, _ in VARIANTS)) -> dict:  # fmt: skip
    from transformers import AutoTokenizer

    snapshot = models_dir / SMOLLM2_MODEL_ID
    prompt = AutoTokenizer.from_pretrained(snapshot)(CODE_PROMPT).input_ids
    results: dict = {"prompt_tokens": len(prompt), "tokens": tokens, "rows": []}
    step0 = None
    reference_text = None
    for mode, flags in VARIANTS:
        if mode not in variants:
            continue
        with relayed_swarm(models_dir, threads, flags) as (swarm, control):
            url = swarm.tracker_url
            for delay in delays:
                set_links(control, delay)
                time.sleep(LINK_SETTLE_S)
                runs = [decode_run(url, prompt, tokens) for _ in range(repeat)]
                best = max(runs, key=lambda r: r["tok_s"])
                if mode == "plain" and delay == 0:
                    step0 = best["wall_s"] / tokens
                    reference_text = best["text"]
                if step0 is None:  # without the plain variant: this one's own undelayed step
                    step0, reference_text = best["wall_s"] / tokens, best["text"]
                bound = 1.0 / (step0 + 2 * HOPS * delay / 1000.0)
                row = {
                    "variant": mode, "delay_ms": delay,
                    "tok_s": [round(r["tok_s"], 2) for r in runs],
                    "bound_tok_s": round(bound, 2),
                    "ratio_to_bound": round(best["tok_s"] / bound, 2),
                    "tokens_per_traversal": round(best["tokens_per_traversal"], 2),
                    "same_text": all(r["text"] == reference_text for r in runs),
                }  # fmt: skip
                results["rows"].append(row)
                print_row(row)
            if mode == "direct+spec":
                set_links(control, 0.0, 100.0)
                time.sleep(LINK_SETTLE_S)
                long_prompt = (prompt * (2048 // len(prompt) + 1))[:2048]
                with httpx.Client(timeout=600) as client:
                    ms = min(ttft_ms(client, url, SMOLLM2_MODEL_ID, long_prompt)
                             for _ in range(repeat))  # fmt: skip
                # bf16 activations (576 wide) over each of the 2 links, before compression
                wire_ms = 2048 * 576 * 2 * 8 / 100e6 * 1000 * HOPS
                results["ttft_2048_100mbit_ms"] = round(ms, 1)
                results["ttft_wire_bound_ms"] = round(wire_ms, 1)
                print(f"TTFT 2048 tokens at 100 Mbit/s: {ms:.0f} ms "
                      f"(raw activations alone need {wire_ms:.0f} ms on the links)")  # fmt: skip
    return results


def print_row(row: dict) -> None:
    print(
        f"{row['variant']:11} delay {row['delay_ms']:>4} ms: "
        f"{max(row['tok_s']):6.2f} tok/s (runs {row['tok_s']}), bound {row['bound_tok_s']:6.2f}, "
        f"ratio {row['ratio_to_bound']:.2f}, tokens/traversal {row['tokens_per_traversal']:.2f}, "
        f"same text {row['same_text']}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays", default="0,5,25", help="one-way delays, ms")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="one run, 64 tokens")
    parser.add_argument("--variants", default=",".join(v for v, _ in VARIANTS),
                        help="which of " + ", ".join(v for v, _ in VARIANTS))  # fmt: skip
    parser.add_argument("--models-dir", default=str(REPO_ROOT / ".cache" / "test-models"))
    args = parser.parse_args()
    models_dir = Path(args.models_dir)
    import_smollm2(models_dir)
    runs, tokens = (1, 64) if args.quick else (args.runs, args.tokens)
    delays = [float(d) for d in args.delays.split(",")]
    started = time.time()
    variants = tuple(args.variants.split(","))
    results = run(models_dir, delays, tokens, args.threads, runs, variants)
    results["seconds"] = round(time.time() - started, 1)
    print(f"wrote {write_json('network.json', results)}")


if __name__ == "__main__":
    main()
