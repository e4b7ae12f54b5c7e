"""End-to-end throughput of a meshnet swarm against single-process transformers.

On SmolLM2-135M-Instruct (bf16, 30 layers), in one run:

(a) HF baseline: ``AutoModelForCausalLM.generate`` greedy with a KV cache, exactly 128 new
    tokens (EOS off, see ``hf_ref.py``), same torch threads as the nodes;
(b) meshnet as real processes on 127.0.0.1: a tracker node alone serving [0, 30); a tracker
    node [0, 15) + a node [15, 30); a tracker node [0, 10) + nodes [10, 20) and [20, 30).
    POST /v1/completions, temperature 0, max_tokens 128, ignore_eos: tokens/s from
    usage.completion_tokens / wall time; TTFT = time to the first SSE data chunk of a
    streamed request (short and long prompt);
(c) bytes on the wire per decoded token and per 128-token prefill chunk, measured with
    ``meshnet_common.wire.encode_tensor`` on real SmolLM2 hidden states at the stage
    boundaries (layers run in-process), against raw bf16 and base64-in-JSON; codec speed.

Every timing is the median of N runs (default 3) with min and max. Prints tables and
writes ``bench/results/pipeline.json``. ``make bench`` runs ``perf.py`` instead, which
covers more; this script remains for the 1/2/3-process comparison in one table.

    .venv/bin/python bench/pipeline.py [--quick] [--runs N] [--models-dir DIR] [--threads T]
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from benchlib import (
    REPO_ROOT,
    busy_flag,
    environment,
    fmt_summary,
    print_table,
    steady_runs,
    summary,
    wait_quiet,
    write_json,
)
from hf_ref import greedy, load_model, prefill_ms
from swarm import REQUEST_TIMEOUT_S, Swarm, complete, running_swarm, stop_on_sigterm, ttft_ms
from wire_bench import WIRE_BOUNDARIES, measure_wire, print_wire

from meshnet_common.models.gguf_import import SMOLLM2_MODEL_ID, import_smollm2
from meshnet_common.tiny.snapshots import CORPUS

MODEL_ID = SMOLLM2_MODEL_ID
NUM_LAYERS = 30
CONFIGS: dict[str, list[tuple[int, int]]] = {  # name -> layer ranges, tracker node first
    "meshnet 1 proc": [(0, 30)],
    "meshnet 2 procs": [(0, 15), (15, 30)],
    "meshnet 3 procs": [(0, 10), (10, 20), (20, 30)],
}
SHORT_PROMPT = "The capital of France is Paris. Once upon a time there was a small cat who"
LONG_PROMPT_TOKENS = 384  # three 128-token prefill chunks


@dataclass
class Prompts:
    """Token-id prompts sent identically to HF and to meshnet."""

    short: list[int]
    long: list[int]


@dataclass(frozen=True)
class Plan:
    """What to measure and how often (from the command line)."""

    models_dir: Path
    threads: int
    runs: int
    new_tokens: int
    retries: int
    wait_idle: float


def make_prompts(snapshot: Path) -> Prompts:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    short = tokenizer(SHORT_PROMPT).input_ids
    corpus = tokenizer(CORPUS * 2).input_ids
    return Prompts(short=short, long=corpus[:LONG_PROMPT_TOKENS])


# -- (a) single-process HF baseline ----------------------------------------------------------


def hf_baseline(snapshot: Path, prompts: Prompts, plan: Plan) -> dict:
    """Tokens/s and TTFT of plain ``generate`` in this process."""
    model = load_model(snapshot)
    greedy(model, prompts.short, 8)  # warm-up

    def one_run() -> tuple[float, float, float, list[int]]:
        run = greedy(model, prompts.short, plan.new_tokens)
        short = prefill_ms(model, prompts.short)
        long_ = prefill_ms(model, prompts.long)
        return len(run.token_ids) / run.elapsed_s, short, long_, run.token_ids

    kept, other = steady_runs(plan.runs, one_run, retries=plan.retries, wait_s=plan.wait_idle)
    return {
        "tokens_per_s": summary([k[0] for k in kept]),
        "ttft_short_ms": summary([k[1] for k in kept]),
        "ttft_long_ms": summary([k[2] for k in kept]),
        "completion_tokens": len(kept[-1][3]),
        "token_ids": kept[-1][3],
        "other_cores": other,
    }


# -- (b) meshnet swarm as real processes -----------------------------------------------------


def measure_swarm(swarm: Swarm, prompts: Prompts, plan: Plan) -> dict:
    """Tokens/s and TTFT through the tracker's OpenAI endpoint."""
    url = swarm.tracker_url
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        complete(client, url, MODEL_ID, prompts.short, 8)  # warm-up (first-request paths)
        ttft_ms(client, url, MODEL_ID, prompts.long)

        def one_run() -> tuple[float, float, float, str]:
            res = complete(client, url, MODEL_ID, prompts.short, plan.new_tokens)
            short = ttft_ms(client, url, MODEL_ID, prompts.short)
            long_ = ttft_ms(client, url, MODEL_ID, prompts.long)
            return res["tokens"] / res["wall_s"], short, long_, res["text"]

        kept, other = steady_runs(
            plan.runs, one_run, pids=lambda: swarm.pids,
            retries=plan.retries, wait_s=plan.wait_idle,
        )  # fmt: skip
    return {
        "tokens_per_s": summary([k[0] for k in kept]),
        "ttft_short_ms": summary([k[1] for k in kept]),
        "ttft_long_ms": summary([k[2] for k in kept]),
        "completion_tokens": plan.new_tokens,
        "text": kept[-1][3],
        "other_cores": other,
    }


def run_config(plan: Plan, name: str, ranges, prompts: Prompts) -> dict:
    """Start one swarm layout, measure it, and always stop its processes."""
    t0 = time.perf_counter()
    with running_swarm(plan.models_dir, MODEL_ID, ranges, plan.threads, name) as swarm:
        ready_s = time.perf_counter() - t0
        wait_quiet(plan.wait_idle, name)
        result = measure_swarm(swarm, prompts, plan)
        result["rss_mib_per_process"] = swarm.rss_mib()
    result["ranges"] = [list(r) for r in ranges]
    result["processes"] = len(ranges)
    result["startup_s"] = ready_s
    return result


# -- report ----------------------------------------------------------------------------------


def compare_text(hf: dict, snapshot: Path, mesh: dict) -> dict:
    """Does meshnet's greedy text equal HF's? (bf16 chunking may flip a near-tie.)"""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    ref = tokenizer.decode(hf["token_ids"], skip_special_tokens=True)
    got = mesh["text"]
    prefix = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
    common = min(len(ref), len(got)) if prefix is None else prefix
    return {"equal": ref == got, "common_prefix_chars": common, "hf_chars": len(ref)}


def print_throughput(hf: dict, mesh: dict[str, dict], new_tokens: int, runs: int) -> None:
    rows = [["HF generate (1 proc)" + busy_flag(hf["other_cores"]), "-",
             fmt_summary(hf["tokens_per_s"]),
             f"{1000 / hf['tokens_per_s']['median']:.1f}", fmt_summary(hf["ttft_short_ms"]),
             fmt_summary(hf["ttft_long_ms"]), "1.00", "1.00", "1.00", "-", "-",
             f"{hf['other_cores']:.2f}"]]  # fmt: skip
    for name, res in mesh.items():
        rows.append([
            name + busy_flag(res["other_cores"]), " ".join(f"[{a},{b})" for a, b in res["ranges"]),
            fmt_summary(res["tokens_per_s"]), f"{1000 / res['tokens_per_s']['median']:.1f}",
            fmt_summary(res["ttft_short_ms"]), fmt_summary(res["ttft_long_ms"]),
            f"{res['ratio_vs_hf']['tokens_per_s']:.2f}", f"{res['ratio_vs_hf']['ttft_short']:.2f}",
            f"{res['ratio_vs_hf']['ttft_long']:.2f}",
            "/".join(f"{r:.0f}" for r in res["rss_mib_per_process"]),
            "yes" if res["text_vs_hf"]["equal"] else f"no@{res['text_vs_hf']['common_prefix_chars']}",
            f"{res['other_cores']:.2f}",
        ])  # fmt: skip
    headers = ["setup", "layers", "tok/s [min-max]", "ms/tok", "TTFT short ms",
               "TTFT long ms", "tok/s /HF", "TTFT-s /HF", "TTFT-l /HF", "RSS MiB/proc",
               "text=HF", "other cores"]  # fmt: skip
    print_table(
        f"Throughput: {MODEL_ID} bf16, {new_tokens} new tokens, greedy; median [min-max] of {runs}",
        headers,
        rows,
    )
    print("TTFT short/long: prompt of the short text / 384 tokens (3 prefill chunks).")
    print("x /HF: meshnet value divided by the HF baseline's (tok/s: higher is better).")
    print("other cores: CPU used by processes not started by this benchmark while it measured;")
    print("(BUSY) marks rows above 0.25 cores, whose timings are not trustworthy.")


def add_ratios(hf: dict, mesh: dict[str, dict]) -> None:
    for res in mesh.values():
        res["ratio_vs_hf"] = {
            "tokens_per_s": res["tokens_per_s"]["median"] / hf["tokens_per_s"]["median"],
            "ttft_short": res["ttft_short_ms"]["median"] / hf["ttft_short_ms"]["median"],
            "ttft_long": res["ttft_long_ms"]["median"] / hf["ttft_long_ms"]["median"],
        }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", default=str(REPO_ROOT / ".cache" / "test-models"))
    parser.add_argument("--runs", type=int, default=3, help="timed runs per measurement")
    parser.add_argument("--quick", action="store_true", help="1 run, 64 new tokens")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of HF and of every node"
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--configs", default="1,2,3", help="swarm layouts to run, by process count (1,2,3)"
    )
    parser.add_argument(
        "--wait-idle", type=float, default=60.0, help="max s to wait for a quiet machine"
    )
    parser.add_argument(
        "--retries", type=int, default=2, help="runs redone when other processes disturb them"
    )
    parser.add_argument("--json", default="pipeline.json", help="file name under bench/results")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.new_tokens < 1 or args.threads < 1 or args.retries < 0:
        parser.error("--runs, --new-tokens and --threads must be >= 1, --retries >= 0")
    if args.quick:
        args.runs, args.new_tokens = 1, 64
    wanted = {c.strip() for c in args.configs.split(",") if c.strip()}
    args.layouts = {k: v for k, v in CONFIGS.items() if str(len(v)) in wanted}
    return args


def main() -> None:
    args = parse_args()
    stop_on_sigterm()
    import torch

    torch.set_num_threads(args.threads)
    plan = Plan(Path(args.models_dir), args.threads, args.runs, args.new_tokens, args.retries,
                args.wait_idle)  # fmt: skip
    snapshot = import_smollm2(plan.models_dir)
    prompts = make_prompts(snapshot)
    print(f"model: {snapshot}; prompts {len(prompts.short)} / {len(prompts.long)} tokens")
    wire = measure_wire(snapshot, prompts.long, repeats=20 if args.quick else 50)
    wait_quiet(plan.wait_idle, "HF baseline")
    hf = hf_baseline(snapshot, prompts, plan)
    gc.collect()  # the HF model is unreferenced now: give its memory back before the swarms
    mesh = {}
    for name, ranges in args.layouts.items():
        mesh[name] = run_config(plan, name, ranges, prompts)
        mesh[name]["text_vs_hf"] = compare_text(hf, snapshot, mesh[name])
    add_ratios(hf, mesh)
    print_throughput(hf, mesh, plan.new_tokens, plan.runs)
    print_wire(wire)
    path = write_json(
        args.json,
        {"environment": environment(plan.threads), "model": MODEL_ID, "snapshot": str(snapshot),
         "new_tokens": plan.new_tokens, "runs": plan.runs,
         "prompt_tokens": {"short": len(prompts.short), "long": len(prompts.long)},
         "hf": hf, "meshnet": mesh, "wire": wire, "wire_boundaries": WIRE_BOUNDARIES},
    )  # fmt: skip
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
