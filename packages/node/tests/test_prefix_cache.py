"""The prefix cache (docs/adr/0035) on in-process stages: a prompt that starts with blocks a
finished session left gives exactly the tokens and logits of computing it all, for every
family (or the family says it cannot keep blocks); eviction under a small budget; salts
that keep tenants apart."""

from __future__ import annotations

import pytest
import torch
from baselines import split_greedy

from meshnet_common.errors import CapacityExceeded, Conflict
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.tiny import snapshots as tiny
from meshnet_node.caching.blocks import (
    BLOCK_TOKENS,
    PrefixPlan,
    block_hashes,
    reusable_blocks,
    seed_of,
)
from meshnet_node.caching.store import PIN_S, PrefixCache
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage

FAMILIES = list(tiny.FAMILIES)
# Families whose tiny models have sliding-window layers: a window cannot be cut back to a
# block boundary, so their stages keep no prefix blocks (docs/adr/0035).
NO_PREFIX_CACHE = {"mistral", "qwen2", "gemma2", "gemma3", "mixtral", "gpt_oss"}
SEED = seed_of("meshnet-tiny/any")


def stages_of(snapshot, precision: Precision, budget: int = 32768, cache: bool = True):
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(snapshot).num_hidden_layers
    bounds = [(0, layers // 2), (layers // 2, layers)]
    return [
        Stage(load_shard(snapshot, LayerRange(s, e), precision), kv_budget_tokens=budget,
              prefix_cache=PrefixCache() if cache else None)
        for s, e in bounds
    ]  # fmt: skip


def cached_greedy(stages, sid: str, prompt: list[int], new: int, seed: str = SEED):
    """Greedy decoding as a head and its hops run it with the prefix cache: each stage
    restores the blocks all of them hold, the prompt's rest runs in wire chunks, every
    stage notes the ids, and the sessions close leaving their prompt's blocks."""
    hashes = block_hashes(seed, prompt[: reusable_blocks(len(prompt)) * BLOCK_TOKENS])
    held = min(stage.sessions.prefix.pin(sid, hashes) if stage.sessions.prefix else 0
               for stage in stages)  # fmt: skip
    sessions = [stage.open_session(sid, keep=PrefixPlan(seed, len(prompt))) for stage in stages]
    for stage, session in zip(stages, sessions, strict=True):
        if held:
            stage.sessions.restore(session, tuple(hashes[:held]))
        elif stage.sessions.prefix:
            stage.sessions.prefix.release(sid)
    position, feed, tokens, logits = held * BLOCK_TOKENS, prompt[held * BLOCK_TOKENS :], [], []
    try:
        for _ in range(new):
            while feed:
                chunk, feed = feed[:BLOCK_TOKENS], feed[BLOCK_TOKENS:]
                out = stages[0].step(sid, position, token_ids=torch.tensor([chunk]))
                for stage, session in zip(stages, sessions, strict=True):
                    if stage is not stages[0]:
                        out = stage.step(sid, position, hidden=out.hidden)
                    stage.sessions.note_ids(session, position, chunk)
                position += len(chunk)
            logits.append(out.logits)
            tokens.append(out.token.token_id)
            feed = [tokens[-1]]
    finally:
        for stage in stages:
            stage.close_session(sid, keep=True)
    return tokens, logits, held * BLOCK_TOKENS


def random_ids(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(
        3, vocab, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", [Precision.FLOAT32, Precision.BFLOAT16], ids=str)
def test_a_cached_prefix_gives_exactly_what_computing_it_gives(tiny_snapshot, family, precision):
    """Turn two of a chat (turn one, its answer, a new message) starts after turn one's
    cached blocks: its tokens and logits are those of the whole prompt computed afresh, bit
    for bit (the blocks are the same 128-token chunks, computed the same way)."""
    snapshot = tiny_snapshot(family)
    stages = stages_of(snapshot, precision)
    vocab = min(stages[0].shard.vocab_size, 200)
    first = random_ids(vocab, 300, 1)
    if any(s.sessions.prefix is None for s in stages):  # sliding windows: documented skip
        assert family in NO_PREFIX_CACHE, f"{family} keeps no prefix blocks"
        return
    assert family not in NO_PREFIX_CACHE
    answer, _, cached = cached_greedy(stages, "turn-1", first, 6)
    assert cached == 0
    assert all(s.sessions.prefix.blocks == 2 for s in stages)  # the prompt's 2 full blocks
    second = first + answer + random_ids(vocab, 150, 2)
    tokens, logits, cached = cached_greedy(stages, "turn-2", second, 8)
    assert cached == 2 * BLOCK_TOKENS
    fresh = stages_of(snapshot, precision, cache=False)
    ref_tokens, ref_logits = split_greedy(fresh, second, 8)
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))


def test_families_that_cannot_keep_blocks_say_so(tiny_snapshot):
    for family in NO_PREFIX_CACHE:
        stages = stages_of(tiny_snapshot(family), Precision.FLOAT32)
        assert any(stage.sessions.prefix is None for stage in stages), family


def test_salts_keep_tenants_apart(tiny_snapshot):
    stages = stages_of(tiny_snapshot("llama"), Precision.FLOAT32)
    prompt = random_ids(200, 400, 3)
    cached_greedy(stages, "a", prompt, 2, seed=seed_of("m", "tenant-a"))
    _, _, cached = cached_greedy(stages, "b", prompt, 2, seed=seed_of("m", "tenant-b"))
    assert cached == 0  # another salt: nothing shared
    _, _, cached = cached_greedy(stages, "a2", prompt, 2, seed=seed_of("m", "tenant-a"))
    assert cached == 3 * BLOCK_TOKENS  # the same salt: the prompt's blocks


def test_entries_live_in_the_kv_budget_and_give_way_to_sessions(tiny_snapshot):
    budget = 6 * BLOCK_TOKENS  # two entries of 2 blocks and one running 261-token session
    stages = stages_of(tiny_snapshot("llama"), Precision.FLOAT32, budget=budget)
    store = stages[1].sessions
    one, two = random_ids(200, 260, 4), random_ids(200, 260, 5)
    cached_greedy(stages, "one", one, 1)
    cached_greedy(stages, "two", two, 1)
    assert store.prefix.blocks == 4 and store.prefix.stats.evicted == 0
    # The next session needs room: the least recently used entry ("one") goes.
    _, _, cached = cached_greedy(stages, "again-two", two, 1)
    assert cached == 2 * BLOCK_TOKENS and store.prefix.stats.evicted == 1
    _, _, cached = cached_greedy(stages, "one-gone", one, 1)
    assert cached == 0


def test_a_promised_entry_is_not_evicted_and_a_live_session_owns_its_copy(tiny_snapshot):
    stages = stages_of(tiny_snapshot("llama"), Precision.FLOAT32, budget=3 * BLOCK_TOKENS)
    store = stages[0].sessions
    prompt = random_ids(200, 300, 7)
    cached_greedy(stages, "first", prompt, 1)
    hashes = block_hashes(SEED, prompt[:256])
    assert store.prefix.pin("next", hashes) == 2
    assert store.prefix.evict(10_000) == 0  # promised: stays
    # A session needing more room than the promised entry leaves is refused, not served by it.
    stages[0].open_session("crowd")
    with pytest.raises(CapacityExceeded):
        stages[0].step("crowd", 0, token_ids=torch.tensor([random_ids(200, 200, 8)]))
    stages[0].close_session("crowd")
    session = stages[0].open_session("next", keep=PrefixPlan(SEED, 300))
    store.restore(session, tuple(hashes))
    assert session.length == 256 and session.cached_tokens == 256
    # No longer promised, the entry gave way to the session's own copy (the budget is 384).
    assert store.prefix.blocks == 0 and store.prefix.stats.evicted == 1
    assert session.cache.layers[0].keys.shape[-2] == 256  # the session's own copy stays


def test_a_miss_is_refused_before_anything_changes(tiny_snapshot):
    stages = stages_of(tiny_snapshot("llama"), Precision.FLOAT32)
    session = stages[1].open_session("miss", keep=PrefixPlan(SEED, 300))
    with pytest.raises(Conflict) as info:
        stages[1].sessions.restore(session, tuple(block_hashes(SEED, list(range(256)))))
    assert info.value.code == "prefix_miss" and session.length == 0


def test_promises_expire():
    clock = [0.0]
    cache = PrefixCache(clock=lambda: clock[0])
    assert cache.pin("s", ["0" * 32]) == 0
    clock[0] += PIN_S + 1
    assert cache.evict(1) == 0


def test_chunks_noted_out_of_order_still_name_the_blocks(tiny_snapshot):
    """Pipelined prefill chunks of one pass resume in any order: ids land by position."""
    stage = stages_of(tiny_snapshot("llama"), Precision.FLOAT32)[0]
    prompt = random_ids(200, 300, 9)
    session = stage.open_session("ooo", keep=PrefixPlan(SEED, 300))
    stage.step("ooo", 0, token_ids=torch.tensor([prompt]))
    for lo in (256, 128, 0):  # the last chunk noted first
        stage.sessions.note_ids(session, lo, prompt[lo : lo + 128])
    stage.close_session("ooo", keep=True)
    assert stage.sessions.prefix.held(block_hashes(SEED, prompt[:256])) == 2
    gap = stage.open_session("gap", keep=PrefixPlan(SEED, 300))
    stage.step("gap", 0, token_ids=torch.tensor([prompt]))
    stage.sessions.note_ids(gap, 128, prompt[128:256])  # chunk 0 never noted
    stage.close_session("gap", keep=True)
    assert stage.sessions.prefix.stats.saved == 1  # nothing known from position 0: not kept


def test_a_promise_taken_back_lets_its_entry_make_room(tiny_snapshot):
    """A session whose opening never reached a hop (a failover upstream) takes its promise
    back; the entry then gives way to the replay that needs the room."""
    stages = stages_of(tiny_snapshot("llama"), Precision.FLOAT32, budget=1100)
    prompt = random_ids(200, 700, 10)
    cached_greedy(stages, "first", prompt, 1)
    tail = stages[1].sessions
    assert tail.prefix.blocks == 5
    assert tail.prefix.pin("lost", block_hashes(SEED, prompt[:640])) == 5
    tail.prefix.release("lost")
    tokens, _ = split_greedy(stages, prompt, 2)  # 701 more tokens: the entry must go
    assert len(tokens) == 2 and tail.prefix.blocks == 0
