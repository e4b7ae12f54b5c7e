"""The measured sections of ``perf.py``: decode, time to first token, concurrency, per-hop
overhead. Each function measures on an already running swarm and returns a JSON-ready dict;
each ``print_*`` prints that dict as a table. See bench/README.md for what is measured.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, replace

import httpx
from benchlib import (
    CpuWatch,
    Slack,
    busy_flag,
    fmt_summary,
    percentile,
    print_table,
    ratio_summary,
    steady_runs,
    summary,
    wait_quiet,
)
from hf_ref import bf16_kernel, greedy, prefill_ms
from swarm import REQUEST_TIMEOUT_S, Swarm, complete, stream_arrivals, ttft_ms

LOGPROB_TOLERANCE = 0.05  # max |meshnet - HF| log-probability of a greedy token
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Repeat:
    """How often a section repeats a measurement, and how it treats disturbed runs."""

    runs: int
    retries: int
    wait_idle: float
    slack: Slack  # shared by every section of a run

    def wait_quiet(self, label: str) -> float:
        return wait_quiet(self.wait_idle, label, self.slack)

    def steady(self, one_run, swarm: Swarm) -> tuple[list, float]:
        """``steady_runs`` of ``one_run``; the swarm's processes count as our own CPU use."""
        return steady_runs(self.runs, one_run, pids=lambda: swarm.pids, retries=self.retries,
                           wait_s=self.wait_idle, slack=self.slack)  # fmt: skip

    def with_runs(self, runs: int) -> Repeat:
        return replace(self, runs=runs)


def _fmt_ranges(ranges) -> str:
    return " ".join(f"[{a},{b})" for a, b in ranges)


# -- 1. decode -------------------------------------------------------------------------------


def _tokens_match(tokenizer, hf, mesh: dict) -> dict:
    """Does meshnet's greedy output equal HF's? Text, and the chosen tokens' log-probs.

    The API returns text, not token ids. A random model emits ids its small tokenizer
    cannot spell (they decode to ""), so the per-token log-probabilities are compared too:
    a different token would show as a different log-probability.
    """
    ref = tokenizer.decode(hf.token_ids, skip_special_tokens=True)
    got = mesh["text"]
    mesh_lp = mesh["response"]["choices"][0]["logprobs"]["token_logprobs"]
    diff = max(abs(a - b) for a, b in zip(hf.logprobs, mesh_lp, strict=True))
    return {
        "text_equal": ref == got,
        "max_logprob_diff": diff,
        "equal": ref == got and diff <= LOGPROB_TOLERANCE,
        "ids_beyond_tokenizer": sum(t >= len(tokenizer) for t in hf.token_ids),
    }


def decode_section(
    model, tokenizer, swarm: Swarm, prompt: list[int], new_tokens: int, repeat: Repeat
) -> dict:
    """Tokens/s of HF ``generate`` and of meshnet, measured back to back; where meshnet's
    bf16 product kernel applies (ADR-0030), HF runs a second time on that kernel, so that
    one ratio compares against plain transformers and the other isolates the distribution."""
    url, model_id = swarm.tracker_url, swarm.model_id
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        greedy(model, prompt, WARMUP_TOKENS)
        complete(client, url, model_id, prompt, WARMUP_TOKENS)

        def one_pair() -> tuple:
            hf = greedy(model, prompt, new_tokens, logprobs=True)
            with bf16_kernel(model) as on:
                hf_kernel = greedy(model, prompt, new_tokens) if on else None
            mesh = complete(client, url, model_id, prompt, new_tokens, logprobs=1)
            return hf, mesh, hf_kernel

        runs, other = repeat.steady(one_pair, swarm)
    pairs = [(hf, mesh) for hf, mesh, _ in runs]
    hf_tps = [new_tokens / hf.elapsed_s for hf, _ in pairs]
    mesh_tps = [new_tokens / mesh["wall_s"] for _, mesh in pairs]
    kernel_tps = [new_tokens / k.elapsed_s for _, _, k in runs if k is not None]
    checks = [_tokens_match(tokenizer, hf, mesh) for hf, mesh in pairs]
    same = all(k is None or k.token_ids == hf.token_ids for hf, _, k in runs)
    timings = [mesh["response"].get("meshnet_timing") for _, mesh in pairs]
    per_hop = [
        t["overhead_per_hop_ms_p50"] for t in timings if t and "overhead_per_hop_ms_p50" in t
    ]
    return {
        "model": model_id,
        "ranges": [list(r) for r in swarm.ranges],
        "prompt_tokens": len(prompt),
        "new_tokens": new_tokens,
        "hf_tokens_per_s": summary(hf_tps),
        "meshnet_tokens_per_s": summary(mesh_tps),
        "ratio": ratio_summary(mesh_tps, hf_tps),
        "hf_kernel_tokens_per_s": summary(kernel_tps) if kernel_tps else None,
        "ratio_same_kernel": ratio_summary(mesh_tps, kernel_tps) if kernel_tps else None,
        "tokens_equal": all(c["equal"] for c in checks) and same,
        "checks": checks,
        "meshnet_timing": timings,
        "overhead_per_hop_ms": summary(per_hop) if per_hop else None,
        "rss_mib_per_process": swarm.rss_mib(),
        "other_cores": other,
    }


def _equal_label(res: dict) -> str:
    checks = res["checks"]
    text = all(c["text_equal"] for c in checks)
    diff = max(c["max_logprob_diff"] for c in checks)
    verdict = "yes" if res["tokens_equal"] else "NO"
    unspellable = max(c["ids_beyond_tokenizer"] for c in checks)
    note = f", {unspellable} ids not in tokenizer" if unspellable else ""
    return f"{verdict} (text {'=' if text else '!='}, dlogp {diff:.3f}{note})"


def print_decode(results: dict[str, dict]) -> None:
    rows = []
    for name, res in results.items():
        hop = res["overhead_per_hop_ms"]
        kernel, same = res.get("hf_kernel_tokens_per_s"), res.get("ratio_same_kernel")
        rows.append([
            name + busy_flag(res["other_cores"]), _fmt_ranges(res["ranges"]), res["new_tokens"],
            fmt_summary(res["hf_tokens_per_s"], 2), fmt_summary(kernel, 2) if kernel else "-",
            fmt_summary(res["meshnet_tokens_per_s"], 2), fmt_summary(res["ratio"], 2),
            fmt_summary(same, 2) if same else "-", fmt_summary(hop, 2) if hop else "-",
            _equal_label(res), "/".join(f"{r:.0f}" for r in res["rss_mib_per_process"]),
            f"{res['other_cores']:.2f}",
        ])  # fmt: skip
    headers = ["model", "meshnet layers", "tokens", "HF tok/s", "HF+kernel tok/s",
               "meshnet tok/s", "ratio", "ratio, same kernel", "overhead/hop ms", "tokens=HF",
               "RSS MiB/proc", "other cores"]  # fmt: skip
    print_table("1. Decode: greedy tokens/s, HF generate (1 proc) vs meshnet (3 procs); "
                "median [min-max]; ratio = meshnet/HF per back-to-back pair", headers, rows)  # fmt: skip
    print(
        f"tokens=HF: greedy text equal and every token's log-prob within "
        f"{LOGPROB_TOLERANCE} of HF's (dlogp: largest difference). The random 1B model"
    )
    print('emits ids its small tokenizer cannot spell (text ""): there the log-probs decide.')
    print("HF+kernel: the same HF model with its bf16 linears on meshnet's bf16 product kernel")
    print("(ADR-0030; same tokens); ratio, same kernel = meshnet / HF+kernel: the distribution's")
    print("own cost. '-': the kernel does not apply on this machine.")


# -- 2. time to first token ------------------------------------------------------------------


def ttft_section(model, swarm: Swarm, prompts: dict[int, list[int]], repeat: Repeat) -> dict:
    """HF single prefill pass vs meshnet's first SSE chunk, per prompt length, in pairs.

    A length whose requests fail is recorded with its error; the others still count.
    """
    by_length, worst = {}, 0.0
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        for n, ids in prompts.items():

            def one_pair(ids=ids) -> tuple[float, float]:  # the URL changes if revived
                return prefill_ms(model, ids), ttft_ms(
                    client, swarm.tracker_url, swarm.model_id, ids
                )

            try:
                swarm.revive()
                one_pair()  # warm-up: allocator, first-request paths
                pairs, other = repeat.steady(one_pair, swarm)
            except Exception as exc:  # reported in the table and the JSON
                by_length[str(n)] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"  TTFT {n} tokens FAILED: {by_length[str(n)]['error'][:300]}", flush=True)
                continue
            hf, mesh = [p[0] for p in pairs], [p[1] for p in pairs]
            by_length[str(n)] = {"hf_ms": summary(hf), "meshnet_ms": summary(mesh),
                                 "ratio": ratio_summary(mesh, hf), "other_cores": other}  # fmt: skip
            worst = max(worst, other)
    return {"ranges": [list(r) for r in swarm.ranges], "prompts": by_length, "other_cores": worst}


def print_ttft(res: dict) -> None:
    rows = []
    for n, r in res["prompts"].items():
        if "error" in r:
            rows.append([n, "-", "-", "FAILED", "-"])
            continue
        rows.append([f"{n}{busy_flag(r['other_cores'])}", fmt_summary(r["hf_ms"]),
                     fmt_summary(r["meshnet_ms"]), fmt_summary(r["ratio"], 2),
                     f"{r['other_cores']:.2f}"])  # fmt: skip
    print_table(
        f"2. Time to first token (ms): HF one prefill pass vs meshnet {_fmt_ranges(res['ranges'])}"
        "; ratio = meshnet/HF per pair",
        ["prompt tokens", "HF ms", "meshnet ms", "ratio", "other cores"],
        rows,
    )
    for n, r in res["prompts"].items():
        if "error" in r:
            print(f"{n} tokens: {r['error'][:400]}")


# -- 3. concurrency --------------------------------------------------------------------------


async def _sessions(swarm: Swarm, prompts: list[list[int]], tokens: int) -> dict:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(
            stream_arrivals(client, swarm.tracker_url, swarm.model_id, p, tokens) for p in prompts
        ))  # fmt: skip
    wall = max(arrivals[-1] for _, arrivals in streams) - t0
    gaps = [(b - a) * 1000 for _, arr in streams for a, b in zip(arr, arr[1:], strict=False)]
    ttfts = [(arr[0] - sent) * 1000 for sent, arr in streams]
    return {
        "aggregate_tokens_per_s": len(prompts) * tokens / wall,
        "token_gap_ms_p50": percentile(gaps, 50),
        "token_gap_ms_p99": percentile(gaps, 99),
        "ttft_ms_p50": percentile(ttfts, 50),
        "wall_s": wall,
    }


def concurrency_section(
    swarm: Swarm, prompts: list[list[int]], sessions: list[int], tokens: int, repeat: Repeat
) -> dict:
    """Aggregate tokens/s and inter-token gaps of N concurrent streamed sessions."""
    asyncio.run(_sessions(swarm, prompts[:2], 4))  # warm-up

    def one_run() -> dict[int, dict]:
        out = {}
        for n in sessions:
            with CpuWatch(lambda: swarm.pids) as watch:
                out[n] = asyncio.run(_sessions(swarm, prompts[:n], tokens))
            out[n]["busy_cores"] = watch.own_cores  # the swarm's and this client's CPU use
        return out

    runs, other = repeat.steady(one_run, swarm)
    base = [run[sessions[0]]["aggregate_tokens_per_s"] for run in runs]
    out = {}
    for n in sessions:
        agg = [run[n]["aggregate_tokens_per_s"] for run in runs]
        out[str(n)] = {key: summary([run[n][key] for run in runs]) for key in runs[0][n]}
        out[str(n)]["vs_first"] = ratio_summary(agg, base)
    return {"ranges": [list(r) for r in swarm.ranges], "tokens_per_session": tokens,
            "prompt_tokens": len(prompts[0]), "sessions": out, "other_cores": other}  # fmt: skip


def print_concurrency(res: dict, note: str = "") -> None:
    flag = busy_flag(res["other_cores"])
    rows = [
        [
            f"{n}{flag}",
            fmt_summary(r["aggregate_tokens_per_s"]),
            fmt_summary(r["vs_first"], 2),
            fmt_summary(r["token_gap_ms_p50"]),
            fmt_summary(r["token_gap_ms_p99"]),
            fmt_summary(r["ttft_ms_p50"]),
            fmt_summary(r["busy_cores"], 2) if "busy_cores" in r else "-",
            f"{res['other_cores']:.2f}",
        ]  # fmt: skip
        for n, r in res["sessions"].items()
    ]
    headers = ["sessions", "aggregate tok/s", "vs 1 session", "token gap p50 ms",
               "token gap p99 ms", "TTFT p50 ms", "busy cores", "other cores"]  # fmt: skip
    print_table(
        f"3. Concurrency: streamed sessions of {res['tokens_per_session']} tokens on "
        f"{_fmt_ranges(res['ranges'])}{note}; median [min-max] over runs",
        headers,
        rows,
    )
    print("aggregate = all tokens / wall time from the first request to the last token;")
    print("token gap = time between consecutive SSE chunks of a session (all sessions pooled);")
    print(
        f"busy cores = CPU time of the swarm and this client / wall time ({os.cpu_count()} "
        "cores here): at the core count, more sessions cannot add throughput."
    )


# -- 5. per-hop overhead ---------------------------------------------------------------------


def overhead_section(swarm: Swarm, prompt: list[int], tokens: int, repeat: Repeat) -> dict:
    """``meshnet_timing`` of non-streamed completions: decode step time outside compute."""
    url, model_id = swarm.tracker_url, swarm.model_id
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        complete(client, url, model_id, prompt, WARMUP_TOKENS)

        def one_run() -> dict:
            return complete(client, url, model_id, prompt, tokens)

        runs, other = repeat.steady(one_run, swarm)
    out = {
        "ranges": [list(r) for r in swarm.ranges],
        "tokens": tokens,
        "tokens_per_s": summary([tokens / r["wall_s"] for r in runs]),
        "timing_runs": [r["response"].get("meshnet_timing") for r in runs],
        "other_cores": other,
    }
    return {**out, **timing_summary(out["timing_runs"])}


def timing_summary(timings: list[dict | None]) -> dict:
    """Median/min/max over runs of each ``meshnet_timing`` figure (None when absent)."""
    present = [t for t in timings if t]
    if not present:
        return {"hops": None, "error": "responses carry no meshnet_timing"}
    out: dict = {"hops": present[0]["hops"]}
    for key in ("step_ms_p50", "compute_ms_p50", "overhead_ms_p50", "overhead_per_hop_ms_p50"):
        values = [t[key] for t in present if key in t]
        out[key.removesuffix("_p50")] = summary(values) if values else None
    return out


def print_overhead(results: dict[str, dict]) -> None:
    rows = []
    for name, res in results.items():
        if res.get("hops") is None:
            rows.append([name, _fmt_ranges(res["ranges"]), "-", fmt_summary(res["tokens_per_s"]),
                         "-", "-", "-", "missing meshnet_timing", f"{res['other_cores']:.2f}"])  # fmt: skip
            continue
        hop = res["overhead_per_hop_ms"]
        rows.append([
            name + busy_flag(res["other_cores"]), _fmt_ranges(res["ranges"]), res["hops"],
            fmt_summary(res["tokens_per_s"]), fmt_summary(res["step_ms"]),
            fmt_summary(res["compute_ms"]), fmt_summary(res["overhead_ms"], 2),
            fmt_summary(hop, 2) if hop else "- (no hop)", f"{res['other_cores']:.2f}",
        ])  # fmt: skip
    headers = ["layout", "layers", "hops", "tok/s", "step ms", "compute ms", "overhead ms",
               "overhead/hop ms", "other cores"]  # fmt: skip
    print_table("5. Per-hop overhead of a decode step (meshnet_timing; medians per request, "
                "then median [min-max] over runs)", headers, rows)  # fmt: skip
    print("step: wall time of a decode step at the head; compute: model compute of every hop")
    print("(each node's compute thread); overhead = step - compute, per network hop.")
