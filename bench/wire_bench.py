"""Bytes on the wire per hop, measured on real SmolLM2 activations (used by pipeline.py).

The first layers run in-process (``load_shard`` + ``Stage``) on a 128-token prefill chunk
and on 32 teacher-forced decode tokens; the hidden states at each stage boundary are
packed with ``meshnet_common.wire.encode_tensor`` and compared with raw bf16 bytes and
with base64 inside JSON. The codec is timed on the same tensors.
"""

from __future__ import annotations

import base64
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from benchlib import CpuWatch, busy_flag, print_table, summary

WIRE_BOUNDARIES = (10, 15, 20)  # layer after which activations leave a process
DECODE_STEPS = 32
CHUNK_TOKENS = 128


def boundary_activations(snapshot: Path, token_ids: list[int]) -> dict[int, dict]:
    """Hidden states leaving layers 10, 15 and 20: one prefill chunk and decode steps."""
    import torch

    from meshnet_common.layers import LayerRange
    from meshnet_common.precision import Precision
    from meshnet_node.engine.loader import load_shard
    from meshnet_node.engine.stage import Stage

    edges = (0, *WIRE_BOUNDARIES)
    stages = [
        Stage(load_shard(snapshot, LayerRange(a, b), Precision.BFLOAT16))
        for a, b in zip(edges, edges[1:], strict=False)
    ]
    for stage in stages:
        stage.open_session("wire")
    out = {b: {"chunk": None, "tokens": []} for b in WIRE_BOUNDARIES}
    feeds = [token_ids[:CHUNK_TOKENS]] + [[t] for t in token_ids[CHUNK_TOKENS:][:DECODE_STEPS]]
    position = 0
    for feed in feeds:
        hidden = stages[0].step("wire", position, token_ids=torch.tensor([feed])).hidden
        for boundary, stage in zip(WIRE_BOUNDARIES, [*stages[1:], None], strict=True):
            if len(feed) > 1:
                out[boundary]["chunk"] = hidden
            else:
                out[boundary]["tokens"].append(hidden)
            if stage is not None:
                hidden = stage.step("wire", position, hidden=hidden).hidden
        position += len(feed)
    return out


def json_b64(tensor) -> bytes:
    """How a naive implementation would ship a tensor: base64 bytes inside JSON."""
    import torch

    raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    payload = {"dtype": "bfloat16", "shape": list(tensor.shape),
               "data": base64.b64encode(raw).decode("ascii")}  # fmt: skip
    return json.dumps(payload).encode()


def from_json_b64(body: bytes):
    import torch

    payload = json.loads(body)
    raw = bytearray(base64.b64decode(payload["data"]))
    return torch.frombuffer(raw, dtype=torch.uint8).view(torch.bfloat16).reshape(payload["shape"])


def sizes(tensor) -> dict:
    """Byte counts of one tensor in each encoding."""
    from meshnet_common.wire import WireOptions, encode_tensor

    return {
        "raw_bf16": tensor.numel() * tensor.element_size(),
        "frame": len(encode_tensor(tensor)),  # default: byte shuffle + zstd level 1
        "frame_uncompressed": len(encode_tensor(tensor, WireOptions(zstd_level=0))),
        "frame_zstd_no_shuffle": len(encode_tensor(tensor, WireOptions(shuffle=False))),
        "base64_json": len(json_b64(tensor)),
    }


def _median_sizes(tensors: list) -> dict:
    per = [sizes(t) for t in tensors]
    return {key: statistics.median(s[key] for s in per) for key in per[0]}


def _time_ms(fn: Callable[[], object], repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return summary(times)


def codec_speed(tensor, repeats: int) -> dict:
    """Encode/decode times of the meshnet frame and of base64 JSON for one tensor."""
    from meshnet_common.wire import decode_tensor, encode_tensor

    frame, js = encode_tensor(tensor), json_b64(tensor)
    raw_mb = tensor.numel() * tensor.element_size() / 1e6
    out = {
        "frame_encode_ms": _time_ms(lambda: encode_tensor(tensor), repeats),
        "frame_decode_ms": _time_ms(lambda: decode_tensor(frame), repeats),
        "json_encode_ms": _time_ms(lambda: json_b64(tensor), repeats),
        "json_decode_ms": _time_ms(lambda: from_json_b64(js), repeats),
    }
    for key in list(out):
        out[key.replace("_ms", "_mb_per_s")] = raw_mb / (out[key]["median"] / 1000)
    return out


def header_bytes() -> int:
    """meshnet's own headers on a decode-step POST (route with one more hop)."""
    from meshnet_node.dataplane.steps import Step

    step = Step("0" * 32, "0" * 32, 1000, route=("http://127.0.0.1:65535",), sample=True)
    headers = step.to_headers()
    return sum(len(k) + len(v) + 4 for k, v in headers.items())  # "k: v\r\n"


def measure_wire(snapshot: Path, token_ids: list[int], repeats: int = 50) -> dict:
    """Sizes at every boundary, codec speed at the first one."""
    if len(token_ids) < CHUNK_TOKENS + DECODE_STEPS:
        raise ValueError(f"need {CHUNK_TOKENS + DECODE_STEPS} token ids")
    acts = boundary_activations(snapshot, token_ids)
    first = acts[WIRE_BOUNDARIES[0]]
    with CpuWatch() as watch:
        speed = {
            "prefill_chunk": codec_speed(first["chunk"], repeats),
            "decode_token": codec_speed(first["tokens"][0], repeats * 10),
        }
    return {
        "sizes": {
            str(b): {"decode_token": _median_sizes(a["tokens"]), "prefill_chunk": sizes(a["chunk"])}
            for b, a in acts.items()
        },
        "speed": speed,
        "speed_other_cores": watch.other_cores,
        "meshnet_header_bytes": header_bytes(),
        "decode_steps": DECODE_STEPS,
        "chunk_tokens": CHUNK_TOKENS,
    }


def print_wire(wire: dict) -> None:
    rows = []
    for boundary, kinds in wire["sizes"].items():
        for kind, s in kinds.items():
            rows.append([
                f"after layer {boundary}", kind, f"{s['raw_bf16']:.0f}", f"{s['frame']:.0f}",
                f"{s['frame'] / s['raw_bf16']:.3f}", f"{s['frame_uncompressed']:.0f}",
                f"{s['frame_zstd_no_shuffle']:.0f}", f"{s['base64_json']:.0f}",
                f"{s['base64_json'] / s['frame']:.2f}",
            ])  # fmt: skip
    headers = ["boundary", "payload", "raw bf16 B", "frame B", "frame/raw", "no-zstd B",
               "zstd no-shuffle B", "base64 JSON B", "json/frame"]  # fmt: skip
    print_table("Wire bytes per hop (SmolLM2 hidden 576, bf16, real activations)", headers, rows)
    print(f"decode_token: median over {wire['decode_steps']} steps; frame = shuffle + zstd 1; "
          f"meshnet headers add ~{wire['meshnet_header_bytes']} B per step.")  # fmt: skip
    _print_speed(wire["speed"], wire["speed_other_cores"])


def _print_speed(speed: dict, other_cores: float) -> None:
    rows = []
    for kind, s in speed.items():
        unit, scale = ("ms", 1.0) if kind == "prefill_chunk" else ("us", 1000.0)
        for codec in ("frame", "json"):
            enc, dec = s[f"{codec}_encode_ms"], s[f"{codec}_decode_ms"]
            rows.append([
                kind, "meshnet frame" if codec == "frame" else "base64 JSON",
                f"{enc['median'] * scale:.1f} {unit}", f"{s[f'{codec}_encode_mb_per_s']:.0f}",
                f"{dec['median'] * scale:.1f} {unit}", f"{s[f'{codec}_decode_mb_per_s']:.0f}",
            ])  # fmt: skip
    headers = ["payload", "codec", "encode", "enc MB/s", "decode", "dec MB/s"]
    title = f"Codec speed (median; MB/s of raw bf16 bytes){busy_flag(other_cores)}"
    print_table(title, headers, rows)
    print(f"other processes used {other_cores:.2f} cores meanwhile")
