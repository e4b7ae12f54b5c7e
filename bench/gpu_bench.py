"""Decode on one GPU (issue 54): HF eager against meshnet on one node and on three, with the
memory limit beside them, in one run.

For each shape (random Llama-shaped models, built once under ``--models-dir``; "1.2B": 16
layers of 2048, "7.4B": 32 layers of 4096, both vocab 49152 and 8 KV heads) it prints:

- HF eager, one process: greedy ``generate`` of ``--tokens`` tokens, one stream and a batch
  of ``--streams`` (run in a child with ``--hf-pythonpath``: on the device machine the
  image's own transformers runs the baseline, FACTS.md);
- meshnet one node (a tracker node serving every layer) and three nodes (tracker node and
  two nodes, thirds of the layers), all on the same GPU: one stream, and ``--streams``
  concurrent streams over the three; bf16, and ``--int4`` the three nodes in int4;
- the memory limit: weight bytes a token reads (every layer's matrices and the LM head; one
  embedding row) over the device's bandwidth (``--bandwidth-gbs``, or known for H100 /
  H200), and each figure's share of it;
- seconds from start to covered, and the per-hop time ((3 nodes - 1 node) / 2 per token).

On a CPU (``--device cpu --shapes tiny``) it runs the same steps on a tiny model: a check of
the script, not a figure. Results go to ``bench/results/gpu.json``.

    python bench/gpu_bench.py [--shapes 1.2B,7.4B] [--tokens 128] [--streams 16] [--int4 1.2B]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import REPO_ROOT, print_table, write_json

# The HF child runs on the device image's own transformers (``--hf-pythonpath``), where httpx
# and meshnet may be absent: they are imported where the swarm is run.

SHAPES = {  # name -> make_tiny's shape
    "tiny": {"layers": 6, "hidden": 128, "intermediate": 256, "heads": 4, "kv_heads": 2},
    "1.2B": {"layers": 16, "hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 8,
             "vocab_size": 49152},
    "7.4B": {"layers": 32, "hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8,
             "vocab_size": 49152},
}  # fmt: skip
BANDWIDTH_GBS = {"H200": 4800, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350, "A100": 2039}
PROMPT_TOKENS = 32


def model_id(shape: str) -> str:
    return f"meshnet-gpu-bench/llama-{shape.lower()}"


def prompt(i: int = 0) -> list[int]:
    return [(37 * (j + 1) + 101 * i) % 490 + 10 for j in range(PROMPT_TOKENS)]  # any vocab here


# -- the model -------------------------------------------------------------------------------


def ensure_model(models_dir: Path, shape: str) -> Path:
    """The random snapshot of ``shape`` (built in a child the first time; cached)."""
    code = ("import sys; from meshnet_common.tiny.snapshots import make_tiny; "
            f"print(make_tiny(sys.argv[1], 'llama', {model_id(shape)!r}, **{SHAPES[shape]!r}))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(models_dir)], capture_output=True,
                         text=True, cwd=REPO_ROOT, check=False)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"building {shape} failed:\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def bytes_per_token(snapshot: Path, int4_group: int | None = None) -> float:
    """Weight bytes one decode token reads: each layer's matrices (bf16, or int4 codes with a
    bf16 scale and zero per group), norms, and the LM head (tied or not: the head reads the
    whole matrix); the embedding gives one row."""
    config = json.loads((snapshot / "config.json").read_text())
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]  # fmt: skip
    d = config.get("head_dim") or h // heads
    linear = h * heads * d * 2 + h * kv * d * 2 + 3 * h * i
    per_weight = 2.0 if int4_group is None else 0.5 + 4 / int4_group
    return layers * (linear * per_weight + 2 * h * 2) + config["vocab_size"] * h * 2


def bandwidth_gbs(device: str, given: float | None) -> float | None:
    if given:
        return given
    if not device.startswith("cuda"):
        return None
    import torch

    name = torch.cuda.get_device_name()
    return next((bw for key, bw in BANDWIDTH_GBS.items() if key in name), None)


# -- HF eager (a child, with its own transformers) -------------------------------------------


def hf_child(args: argparse.Namespace) -> None:
    """Child mode: time HF's greedy ``generate``, one stream and a batch; print JSON."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.hf_child, dtype=torch.bfloat16)
    model = model.to(args.device).eval()

    def run(batch: int, tokens: int) -> tuple[float, list[int]]:
        ids = torch.tensor([prompt(b) for b in range(batch)], device=args.device)
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=tokens, min_new_tokens=tokens,
                                 eos_token_id=None, pad_token_id=0)  # fmt: skip
        sync()
        return batch * tokens / (time.perf_counter() - t0), out[0, ids.shape[1] :].tolist()

    run(1, 8)  # warm-up
    ones = [run(1, args.tokens) for _ in range(args.runs)]
    many = statistics.median(run(args.streams, args.tokens)[0] for _ in range(args.runs))
    print(json.dumps({"one": statistics.median(r[0] for r in ones), "batch": many,
                      "tokens": ones[0][1]}), flush=True)  # fmt: skip


def hf_eager(args: argparse.Namespace, snapshot: Path) -> dict:
    env = {**os.environ}
    if args.hf_pythonpath is not None:
        env["PYTHONPATH"] = args.hf_pythonpath
    cmd = [sys.executable, str(Path(__file__).resolve()), "--hf-child", str(snapshot),
           "--device", args.device, "--tokens", str(args.tokens), "--streams", str(args.streams),
           "--runs", str(args.runs)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, check=False)
    if out.returncode != 0:
        return {"error": out.stderr[-1500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- meshnet ---------------------------------------------------------------------------------


async def _streams(url: str, model: str, count: int, tokens: int) -> float:
    import httpx
    from swarm import stream_arrivals

    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=count + 4)) as client:  # fmt: skip
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(
            stream_arrivals(client, url, model, prompt(i), tokens) for i in range(count)
        ))  # fmt: skip
    return count * tokens / (max(arrivals[-1] for _, arrivals in runs) - t0)


def meshnet(args, models_dir: Path, shape: str, layers: int, nodes: int, flags: list[str],
            streams: bool) -> dict:  # fmt: skip
    import httpx
    from swarm import Swarm, complete

    cut = [round(layers * k / nodes) for k in range(nodes + 1)]
    ranges = list(zip(cut, cut[1:], strict=False))
    extra = {i: ["--device", args.device, *flags] for i in range(nodes)}
    swarm = Swarm(models_dir, model_id(shape), ranges, None, extra=extra)
    try:
        swarm.start()
        ready = swarm.wait_ready(timeout=900)
        url = swarm.tracker_url
        with httpx.Client(timeout=900) as client:
            complete(client, url, swarm.model_id, prompt(), 4)  # warm-up
            runs = [complete(client, url, swarm.model_id, prompt(), args.tokens)
                    for _ in range(args.runs)]  # fmt: skip
            # each token's text, untimed: a random model's byte tokens make no whole text
            scored = complete(client, url, swarm.model_id, prompt(), args.tokens, logprobs=0)
        out = {"ready_s": ready, "one": statistics.median(r["tokens"] / r["wall_s"] for r in runs),
               "pieces": scored["response"]["choices"][0]["logprobs"]["tokens"]}  # fmt: skip
        if streams:
            out["streams"] = statistics.median(
                asyncio.run(_streams(url, swarm.model_id, args.streams, args.tokens))
                for _ in range(args.runs)
            )
        return out
    except Exception as exc:  # a figure that failed: say why, go on with the others
        return {"error": f"{type(exc).__name__}: {exc}"[:1500]}
    finally:
        swarm.stop()


def measure(args, models_dir: Path, shape: str) -> dict:
    snapshot = ensure_model(models_dir, shape)
    layers = SHAPES[shape]["layers"]
    res = {"hf": hf_eager(args, snapshot), "bytes_per_token": bytes_per_token(snapshot)}
    res["one_node"] = meshnet(args, models_dir, shape, layers, 1, [], streams=False)
    if args.device == "cuda":  # what the decode graphs give (ADR-0056)
        res["one_node_no_graphs"] = meshnet(args, models_dir, shape, layers, 1,
                                            ["--no-cuda-graphs"], streams=False)  # fmt: skip
    res["three_nodes"] = meshnet(args, models_dir, shape, layers, 3, [], streams=True)
    if shape in args.int4:
        res["three_nodes_int4"] = meshnet(args, models_dir, shape, layers, 3,
                                          ["--quantization", "int4"], streams=False)  # fmt: skip
        res["int4_bytes_per_token"] = bytes_per_token(snapshot, int4_group=64)
    if "tokens" in res["hf"]:  # greedy text against HF eager's (bf16 runs)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(snapshot)
        pieces = [tokenizer.decode([t]) for t in res["hf"]["tokens"]]
        for name in ("one_node", "one_node_no_graphs", "three_nodes"):
            if "pieces" in res.get(name, {}):
                res[name]["same_text_as_hf"] = res[name]["pieces"] == pieces
    return res


# -- the table -------------------------------------------------------------------------------


def _fig(value: float | None, limit: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.1f}" + (f" ({100 * value / limit:.0f}%)" if limit else "")


def report(results: dict, bandwidth: float | None, streams: int) -> None:
    rows = []
    for shape, res in results.items():
        limit = bandwidth * 1e9 / res["bytes_per_token"] if bandwidth else None
        hf, one, three = res["hf"], res["one_node"], res["three_nodes"]
        hop = None
        if "one" in one and "one" in three:
            hop = (1000 / three["one"] - 1000 / one["one"]) / 2
        rows.append([f"{shape}, one stream", _fig(hf.get("one"), limit), _fig(one.get("one"), limit),
                     _fig(three.get("one"), limit) + (f", {hop:.2f} ms/hop" if hop else ""),
                     f"{limit:.0f}" if limit else "—"])  # fmt: skip
        if "one_node_no_graphs" in res:
            eager = res["one_node_no_graphs"]
            vs = f" (graphs {one['one'] / eager['one']:.2f}x)" if "one" in one and "one" in eager else ""  # fmt: skip
            rows.append([f"{shape}, one stream, --no-cuda-graphs", "—",
                         _fig(eager.get("one"), limit) + vs, "—", "—"])  # fmt: skip
        rows.append([f"{shape}, {streams} streams", _fig(hf.get("batch"), None), "—",
                     _fig(three.get("streams"), None), "—"])  # fmt: skip
        if "three_nodes_int4" in res:
            int4 = res["three_nodes_int4"]
            ilimit = bandwidth * 1e9 / res["int4_bytes_per_token"] if bandwidth else None
            vs = f" = {int4['one'] / three['one']:.2f}x bf16" if "one" in int4 and "one" in three else ""  # fmt: skip
            rows.append([f"{shape} int4, one stream", "—", "—", _fig(int4.get("one"), ilimit) + vs,
                         f"{ilimit:.0f}" if ilimit else "—"])  # fmt: skip
        for name in ("hf", "one_node", "one_node_no_graphs", "three_nodes", "three_nodes_int4"):
            if "error" in res.get(name, {}):
                print(f"  {shape} {name}: {res[name]['error']}")
        same = {n: res[n]["same_text_as_hf"] for n in ("one_node", "one_node_no_graphs", "three_nodes")
                if "same_text_as_hf" in res.get(n, {})}  # fmt: skip
        if same:
            print(f"  {shape}: greedy text equal to HF eager's: {same}")
        ready = [res[n]["ready_s"] for n in ("one_node", "three_nodes") if "ready_s" in res[n]]
        if ready:
            print(f"  {shape}: start to covered {', '.join(f'{s:.1f}' for s in ready)} s")
    print_table("decode tok/s (share of the memory limit)",
                ["", "HF eager, one process", "meshnet 1 node", "meshnet 3 nodes",
                 "memory limit tok/s"], rows)  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default="1.2B,7.4B")
    p.add_argument("--int4", default="1.2B", help="shapes also run in int4 over 3 nodes")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--bandwidth-gbs", type=float, help="the device's memory bandwidth")
    p.add_argument("--models-dir", default=str(REPO_ROOT / ".cache" / "gpu-bench-models"))
    p.add_argument("--hf-pythonpath", help="PYTHONPATH of the HF baseline's child")
    p.add_argument("--hf-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.int4 = [s for s in args.int4.split(",") if s]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    return args


def main() -> None:
    args = parse_args()
    if args.hf_child:
        hf_child(args)
        return
    models_dir = Path(args.models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    bandwidth = bandwidth_gbs(args.device, args.bandwidth_gbs)
    results = {}
    for shape in args.shapes:
        print(f"{shape}: measuring on {args.device}", flush=True)
        results[shape] = measure(args, models_dir, shape)
    report(results, bandwidth, args.streams)
    write_json("gpu.json", {"device": args.device, "bandwidth_gbs": bandwidth, "args": vars(args),
                            "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
