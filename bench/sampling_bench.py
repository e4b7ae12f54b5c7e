"""Per-token cost of the tail's sampling options against plain greedy decoding.

Two measurements: the sampler alone (one call per token on a SmolLM2-sized vocabulary with a
1024-token history), and whole decode requests on a live swarm (greedy vs penalties vs logit
bias, back to back). ``perf.py``'s ``sampling`` section runs both."""

from __future__ import annotations

import time

import httpx
from benchlib import print_table, ratio_summary, summary
from swarm import REQUEST_TIMEOUT_S, Swarm, complete

PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}
VARIANTS = {
    "greedy": {},
    "penalties": PENALTIES,
    "logit_bias (50 ids)": {"logit_bias": {str(i): -5.0 for i in range(100, 150)}},
    "top_p 0.9 + min_p 0.05": {"temperature": 0.8, "top_p": 0.9, "min_p": 0.05, "seed": 1},
}


def sampler_us(vocab: int = 49152, history: int = 1024, calls: int = 200) -> dict[str, float]:
    """Microseconds per sampler call for each variant (in this process)."""
    import torch

    from meshnet_common.protocol import SamplingSpec
    from meshnet_node.engine.sampling import Sampler

    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    out = {}
    for name, extra in VARIANTS.items():
        spec = {"temperature": 0.0, **extra}
        if "logit_bias" in spec:
            spec["logit_bias"] = tuple((int(k), v) for k, v in spec["logit_bias"].items())
        sampler = Sampler(SamplingSpec(**spec, prompt_tokens=history // 2))
        sampler.observe(0, [(i * 7919) % vocab for i in range(history)])
        for _ in range(10):
            sampler(logits)
        t0 = time.perf_counter()
        for _ in range(calls):
            sampler(logits)
        out[name] = (time.perf_counter() - t0) / calls * 1e6
    return out


def sampling_section(swarm: Swarm, prompt: list[int], new_tokens: int, repeat) -> dict:
    """ms per token of each variant on the swarm, each run paired with a greedy one."""
    url, model_id = swarm.tracker_url, swarm.model_id
    results = {"sampler_us": sampler_us(), "decode": {}}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        complete(client, url, model_id, prompt, 8)
        for name, extra in VARIANTS.items():
            if name == "greedy":
                continue

            def one_pair(extra=extra) -> tuple:
                plain = complete(client, url, model_id, prompt, new_tokens)
                variant = complete(client, url, model_id, prompt, new_tokens, **extra)
                return plain, variant

            pairs, _ = repeat.steady(one_pair, swarm)
            plain_ms = [p["wall_s"] * 1000 / new_tokens for p, _ in pairs]
            variant_ms = [v["wall_s"] * 1000 / new_tokens for _, v in pairs]
            results["decode"][name] = {
                "greedy_ms_per_token": summary(plain_ms),
                "ms_per_token": summary(variant_ms),
                "ratio": ratio_summary(variant_ms, plain_ms),
            }
    return results


def print_sampling(res: dict) -> None:
    micro = res["sampler_us"]
    base = micro["greedy"]
    print_table(
        "sampling: the tail's sampler alone (49152-token vocab, 1024-token history)",
        ["variant", "us / token", "vs greedy"],
        [[name, f"{us:.0f}", f"{us / base:.2f}x"] for name, us in micro.items()],
    )
    rows = [
        [name, f"{r['greedy_ms_per_token']['median']:.2f}", f"{r['ms_per_token']['median']:.2f}",
         f"{r['ratio']['median']:.3f}"]
        for name, r in res["decode"].items()
    ]  # fmt: skip
    print_table(
        "sampling: decode on the swarm, each variant paired with greedy",
        ["variant", "greedy ms/token", "variant ms/token", "ratio"], rows,
    )  # fmt: skip
