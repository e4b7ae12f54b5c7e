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
    # an unbounded array never completes, so the request runs all its tokens under the mask
    "json_schema mask": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "ints",
                "schema": {"type": "array", "items": {"type": "integer"}},
            },
        }
    },
}


def sampler_us(snapshot, history: int = 1024, calls: int = 200) -> dict[str, float]:
    """Microseconds per sampler call for each variant (in this process), on the vocabulary
    of ``snapshot``. The grammar variant advances its matcher one token per call, as decode
    does (the tokens are ones the mask allows)."""
    import torch

    from meshnet_common.protocol import SamplingSpec
    from meshnet_node.engine.constraints import ConstraintFactory, json_grammar
    from meshnet_node.engine.sampling import Sampler

    factory = ConstraintFactory(snapshot)
    vocab = factory._lltokenizer().vocab_size
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    out = {}
    for name, extra in VARIANTS.items():
        spec = {"temperature": 0.0, **extra}
        constraint = None
        if "logit_bias" in spec:
            spec["logit_bias"] = tuple((int(k), v) for k, v in spec["logit_bias"].items())
        if "response_format" in spec:
            schema = spec.pop("response_format")["json_schema"]["schema"]
            spec["grammar"] = json_grammar("json_schema", schema)
            constraint = factory(spec["grammar"])
        prompt = [(i * 7919) % vocab for i in range(history)]
        sampler = Sampler(SamplingSpec(**spec, prompt_tokens=history), constraint)
        sampler.observe(0, prompt)
        position = history
        for step in range(10 + calls):
            if step == 10:
                t0 = time.perf_counter()
            token = sampler(logits).token_id
            sampler.observe(position, [token])  # the next step brings it back
            position += 1
        out[name] = (time.perf_counter() - t0) / calls * 1e6
    return out


def sampling_section(swarm: Swarm, snapshot, prompt: list[int], new_tokens: int, repeat) -> dict:
    """ms per token of each variant on the swarm, each run paired with a greedy one."""
    url, model_id = swarm.tracker_url, swarm.model_id
    results = {"sampler_us": sampler_us(snapshot), "decode": {}}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        complete(client, url, model_id, prompt, 8)
        for name, extra in VARIANTS.items():
            if name == "greedy":
                continue
            complete(client, url, model_id, prompt, 8, **extra)  # one-time costs (tokenizer view)

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
        "sampling: the tail's sampler alone (SmolLM2's 49152-token vocab, 1024-token history)",
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
