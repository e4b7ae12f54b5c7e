"""Speculative decoding: drafts verified by the chain in one pass give exactly the tokens of
one-at-a-time decoding (every family, caches rewound past rejected drafts on every stage),
sampled verification keeps the distribution, and the head's drafter and draft policy."""

from __future__ import annotations

import pytest
import torch
from baselines import hf_chunked_greedy, load_reference_model
from stage_drivers import speculative_greedy
from transformers import AutoConfig

from meshnet_common.errors import Conflict
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.protocol import SamplingSpec
from meshnet_common.tiny import snapshots as tiny
from meshnet_node.engine import bf16_upcast
from meshnet_node.engine.bf16_upcast import widen_linears
from meshnet_node.engine.families import attention_module
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.row_attention import widen_attention
from meshnet_node.engine.sampling import Sampler
from meshnet_node.engine.stage import Stage
from meshnet_node.speculation.drafting import DraftPolicy, NgramDrafter, expected_tokens


def stages_of(snapshot, bounds) -> list[Stage]:
    return [Stage(load_shard(snapshot, LayerRange(*b), Precision.FLOAT32)) for b in bounds]


@pytest.mark.parametrize("family", list(tiny.FAMILIES))
def test_verified_drafts_give_the_tokens_of_plain_decoding(tiny_snapshot, family):
    """Three stages, a 150-token prompt (past every sliding window): accepted, partly and
    wholly rejected drafts, and the tokens equal the unsplit model's greedy ones."""
    snapshot = tiny_snapshot(family)
    model = load_reference_model(snapshot, torch.float32)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, min(model.config.vocab_size, 200), (150,), generator=gen).tolist()
    reference, _ = hf_chunked_greedy(model, prompt, 30)
    n = model.config.num_hidden_layers
    stages = stages_of(snapshot, [(0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)])
    assert speculative_greedy(stages, prompt, reference, model.config.vocab_size) == reference


def test_a_step_may_only_go_back_inside_the_last_drafts(tiny_snapshot):
    (stage,) = stages_of(tiny_snapshot("llama"), [(0, 2)])
    stage.open_session("s")
    stage.step("s", 0, token_ids=torch.tensor([[5, 6, 7, 8]]))
    with pytest.raises(Conflict):  # no drafts yet: positions only move on
        stage.step("s", 2, token_ids=torch.tensor([[9]]))
    stage.step("s", 4, token_ids=torch.tensor([[9, 10, 11]]), drafts=(10, 11))
    assert stage.sessions.get("s").length == 7
    with pytest.raises(Conflict):  # before the drafts' first token
        stage.step("s", 4, token_ids=torch.tensor([[9]]))
    stage.step("s", 5, token_ids=torch.tensor([[12]]))  # 10 kept, 11 not
    assert stage.sessions.get("s").length == 6
    assert stage.sessions.get("s").cache.get_seq_length() == 6


def test_sampled_verification_keeps_the_distribution():
    """The acceptance rule for a draft proposed with certainty: the first token is
    distributed as the first row says, and after an accepted draft the next one as the next
    row says (a statistical check over many seeds)."""
    torch.manual_seed(0)
    rows = torch.randn(2, 6) * 1.5
    drafts = (2, 4)
    first = torch.softmax(rows[0], -1)
    second = torch.softmax(rows[1], -1)
    n = 20000
    counts_first = torch.zeros(6)
    counts_second = torch.zeros(6)
    for seed in range(n):
        out = Sampler(SamplingSpec(temperature=1.0, seed=seed)).verify(rows, drafts)
        counts_first[out[0].token_id] += 1
        if out[0].token_id == drafts[0]:
            assert len(out) == 2
            counts_second[out[1].token_id] += 1
        else:
            assert len(out) == 1  # a rejected draft ends the step with the row's own token
    for counts, p in ((counts_first, first), (counts_second, second)):
        total = counts.sum()
        spread = 5 * torch.sqrt(p * (1 - p) / total)  # five standard errors
        assert torch.all((counts / total - p).abs() <= spread + 1e-3), (counts / total, p)


def test_greedy_verification_keeps_drafts_up_to_the_first_miss():
    rows = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])
    sampler = Sampler(SamplingSpec())
    assert [t.token_id for t in sampler.verify(rows, (1, 2))] == [1, 2, 0]  # all, + 1
    assert [t.token_id for t in sampler.verify(rows, (1, 0))] == [1, 2]  # second missed
    assert [t.token_id for t in sampler.verify(rows, (0, 2))] == [1]  # first missed


def test_ngram_drafter_follows_the_latest_earlier_occurrence():
    drafter = NgramDrafter(max_n=3, min_n=2)
    text = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    drafter.sync(text)
    assert drafter.propose(2) == [7, 8]  # "1 2 3" last came before "7 8"
    drafter.sync([*text, 7])
    assert drafter.propose(3) == [8, 1, 2]
    drafter.sync([5, 6])
    assert drafter.propose(3) == []  # nothing to look up in a new text
    long = list(range(100)) * 3
    drafter.sync(long)
    assert drafter.propose(4) == [0, 1, 2, 3]
    drafter.sync([4, 1, 2, 1, 2, 1, 2])  # a pattern repeating up to the end: it goes on
    assert drafter.propose(5) == [1, 2, 1, 2, 1]
    drafter.sync([4, 5, 5, 5])
    assert drafter.propose(3) == [5, 5, 5]


def test_draft_policy_drafts_only_when_it_pays():
    policy = DraftPolicy(max_draft=8)
    assert policy.choose(0.9, 1) == 0  # measure a plain step first
    policy.observe(0, 0.100)
    assert policy.choose(0.9, 2) == 4  # then a step with drafts
    policy.observe(4, 0.104)  # a slow link: drafts cost little beside it
    assert policy.choose(0.8, 3) >= 4
    assert policy.choose(0.0, 3) == 0  # nothing accepted: no drafting
    assert policy.choose(0.0, 15) == 2  # ... but a probe now and then
    slow = DraftPolicy(max_draft=8)
    slow.observe(0, 0.010)
    slow.observe(4, 0.050)  # compute-bound: each draft costs a whole step
    assert slow.choose(0.7, 3) == 0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_draft_policy_tells_a_slower_link_from_costlier_drafts():
    """Plain steps measured on a fast link, then the link slows down while every step
    drafts: the extra wall time is link (outside the hops' compute), not the drafts' cost,
    so drafting stays on; compute-bound drafts still turn it off."""
    policy = DraftPolicy(max_draft=4)
    for _ in range(3):
        policy.observe(0, 0.080, 0.078)  # loopback: 2 ms of the step outside compute
    policy.observe(2, 0.094, 0.092)  # drafts: 7 ms of compute each
    assert policy.choose(0.6, 3) > 0
    for _ in range(8):
        policy.observe(2, 0.194, 0.092)  # 25 ms links: 100 ms more wall, the same compute
    assert policy.choose(0.6, 12) >= 2  # drafts pay more over slow links, not less
    assert policy.per_draft_s.value == pytest.approx(0.007)
    assert policy.link_s.value > 0.09
    costly = DraftPolicy(max_draft=4)
    costly.observe(0, 0.080, 0.078)
    for _ in range(8):
        costly.observe(2, 0.200, 0.198)  # each draft costs most of a step of compute
    assert costly.choose(0.6, 5) == 0
    assert expected_tokens(1.0, 3) == 4


def _bf16_stages(snapshot, n_layers: int, widen: bool = False) -> list[Stage]:
    bounds = [(0, n_layers // 3), (n_layers // 3, 2 * n_layers // 3), (2 * n_layers // 3, n_layers)]
    shards = [load_shard(snapshot, LayerRange(*b), Precision.BFLOAT16) for b in bounds]
    for shard in shards if widen else ():
        assert widen_linears(shard.modules) > 0  # --widen-bf16, forced whatever the CPU
        for layer in shard.modules.layers:  # and many-row attention (SDPA families)
            widen_attention(attention_module(layer))
    return [Stage(shard) for shard in shards]


def _chain(stages, sid, position, ids, drafts=()):
    """One step through the chain; each stage's output rows (hidden, then the tail's logits)."""
    out = stages[0].step(sid, position, token_ids=torch.tensor([ids]), drafts=drafts)
    rows = [out.hidden]
    for stage in stages[1:]:
        out = stage.step(sid, position, hidden=out.hidden, drafts=drafts)
        rows.append(
            out.hidden if out.hidden is not None else out.logits.reshape(-1, out.logits.shape[-1])
        )
    return rows


def _amd_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as info:
            text = info.read(4096)
    except OSError:
        return False
    return "AuthenticAMD" in text and torch.backends.cpu.get_cpu_capability() == "AVX512"


# Known gap (found 2026-12-03, identical on the commit before issue 34's work): on an AMD
# Zen 4 EPYC (AVX-512 with bf16), glm4_moe's row 3 of a verification pass differs from its
# one-token step by one bf16 ulp in stage 0, deterministically, and the difference moves
# when allocations change (forward hooks that copy tensors make it vanish): a kernel there
# depends on where its operands lie. The speculative text test (tokens) passes.
_GLM_ON_ZEN4 = pytest.mark.xfail(
    _amd_avx512(), reason="glm4_moe verification rows on AMD AVX-512: see the comment above",
    strict=False,
)  # fmt: skip
WIDENED = [
    pytest.param(f, False, marks=_GLM_ON_ZEN4) if f == "glm4_moe" else (f, False)
    for f in tiny.FAMILIES
] + [
    (f, True)
    for f in ("llama", "gpt2", "phi3", "deepseek_v3")  # Linear, Conv1D, fused, MLA
]


@pytest.mark.parametrize(("family", "widen"), WIDENED)
def test_bfloat16_verification_rows_equal_one_token_steps(
    tiny_snapshot, monkeypatch, family, widen
):
    """In bfloat16 a verification pass (a token and 4 drafts) gives, on every stage, the
    rows that five one-token steps give, bit for bit, and leaves the caches so that the
    steps after it (also after a rewind past rejected drafts) agree bit for bit too: the
    greedy text of speculative decoding is that of plain decoding (ADR-0019). With
    ``--widen-bf16`` too: a verification pass is never widened (ADR-0027)."""
    snapshot = tiny_snapshot(family)
    n_layers = AutoConfig.from_pretrained(snapshot).num_hidden_layers
    stages = _bf16_stages(snapshot, n_layers, widen)
    monkeypatch.setattr(bf16_upcast, "ROWS_PER_THREAD", 1)  # 5 rows would be widened
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 200, (150,), generator=gen).tolist()  # past every window
    for sid in ("plain", "spec"):
        for stage in stages:  # recorded: the tail computes every row's logits (else only
            stage.open_session(sid, record=sid == "spec")  # those verification reads)
        for lo in range(0, len(prompt), 128):
            _chain(stages, sid, lo, prompt[lo : lo + 128])
    position = len(prompt)
    for kept in (5, 2, 5, 1):  # rows of each pass the next step keeps (a rewind when < 5)
        ids = torch.randint(3, 200, (5,), generator=gen).tolist()
        verified = _chain(stages, "spec", position, ids, drafts=tuple(ids[1:]))
        for i in range(kept):
            one = _chain(stages, "plain", position + i, [ids[i]])
            for stage_rows, row in zip(verified, one, strict=True):
                assert torch.equal(stage_rows.reshape(5, -1)[i], row.reshape(-1)), (family, i)
        position += kept


def test_a_tail_computes_only_the_logits_verification_reads(tiny_snapshot):
    """A tail verifying drafts computes the first row's logits alone and the others only
    once the first draft is kept; every row it computes is the eagerly computed one, bit
    for bit, and the tokens are the same (ADR-0019)."""
    snapshot = tiny_snapshot("llama")
    layers = AutoConfig.from_pretrained(snapshot).num_hidden_layers
    tail = Stage(load_shard(snapshot, LayerRange(layers // 2, layers), Precision.BFLOAT16))
    gen = torch.Generator().manual_seed(3)
    width = tail.shard.config.hidden_size
    prefix = torch.randn(1, 20, width, generator=gen).bfloat16()
    rows = torch.randn(1, 4, width, generator=gen).bfloat16()

    def fresh(sid: str, record: bool) -> str:
        tail.open_session(sid, record=record)  # recorded: every row computed
        tail.step(sid, 0, hidden=prefix)
        return sid

    eager = tail.step(fresh("eager", True), 20, hidden=rows, drafts=(1, 2, 3))
    assert eager.logits.shape[0] == 4
    best = eager.logits.argmax(dim=-1).tolist()
    wrong = [(t + 1) % eager.logits.shape[1] for t in best]
    cases = [  # drafts, rows read
        ((wrong[0], best[1], best[2]), 1),  # the first draft missed: row 0 alone
        ((best[0], best[1], wrong[2]), 4),  # kept: the other rows together
        ((best[0], best[1], best[2]), 4),
    ]  # fmt: skip
    for n, (drafts, read) in enumerate(cases):
        out = tail.step(fresh(f"lazy{n}", False), 20, hidden=rows, drafts=drafts)
        assert out.logits.shape[0] == read
        assert torch.equal(out.logits, eager.logits[:read])
        tokens = [out.token.token_id, *(t.token_id for t in out.more)]
        kept = next((i for i, (d, b) in enumerate(zip(drafts, best[:3], strict=True)) if d != b), 3)
        assert tokens == best[: kept + 1]
