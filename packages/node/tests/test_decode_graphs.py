"""Decode steps replayed from captured graphs (docs/adr/0056): the bookkeeping on a CPU with
``EagerRecorder`` (a replay runs the captured body again), and CUDA graphs themselves where
a GPU is lent (``gpu``)."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from baselines import split_greedy
from stage_drivers import decode_sessions, draft_plan

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage
from meshnet_node.programs.graphs import (
    SMALLEST,
    CudaRecorder,
    DecodeGraphs,
    EagerRecorder,
    bucket,
)

PROMPT = torch.randint(3, 200, (250,), generator=torch.Generator().manual_seed(4)).tolist()
SPLIT = ((0, 2), (2, 4), (4, 6))


def stages(snapshot, precision, recorder=None, ranges=SPLIT, device="cpu") -> list[Stage]:
    return [Stage(load_shard(snapshot, LayerRange(a, b), precision, device), engine="program",
                  graphs=recorder) for a, b in ranges]  # fmt: skip


def test_capacities_are_powers_of_two_from_the_smallest_within_the_context():
    assert [bucket(n) for n in (1, 256, 257, 600, 1025)] == [SMALLEST, 256, 512, 1024, 2048]
    assert bucket(600, limit=700) == 700  # the context caps it
    assert bucket(900, limit=700) == 900  # never below what it must hold


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_replayed_steps_give_the_eager_stages_tokens(tiny_snapshot, family):
    """A 250-token prompt and 20 greedy steps over three stages: the same tokens as the
    stages without graphs, logits within float32 rounding; each stage captured its graph at
    the first step and again where the positions outgrew 256."""
    snapshot = tiny_snapshot(family)
    eager = split_greedy(stages(snapshot, Precision.FLOAT32), PROMPT, 20)
    recorder = EagerRecorder()
    replayed = split_greedy(stages(snapshot, Precision.FLOAT32, recorder), PROMPT, 20)
    assert replayed[0] == eager[0]
    for a, b in zip(replayed[1], eager[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert recorder.captures == 3 * 2


@pytest.mark.parametrize("precision", [Precision.BFLOAT16, Precision.FLOAT32], ids=str)
def test_a_split_replays_the_unsplit_stages_bits(tiny_snapshot, precision):
    """Every stage attends over the capacity its position gives: three stages and one
    stage of all six layers, both replaying, give the same logits bit for bit."""
    snapshot = tiny_snapshot("llama")
    split = split_greedy(stages(snapshot, precision, EagerRecorder()), PROMPT, 12)
    whole = split_greedy(stages(snapshot, precision, EagerRecorder(), ((0, 6),)), PROMPT, 12)
    assert split[0] == whole[0]
    assert all(torch.equal(a, b) for a, b in zip(split[1], whole[1], strict=True))


def test_sliding_window_stages_run_their_steps_as_before(tiny_snapshot):
    """Gemma 3's sliding layers keep transformers' own cache: no graph, the same bits."""
    snapshot = tiny_snapshot("gemma3")
    eager = split_greedy(stages(snapshot, Precision.FLOAT32), PROMPT[:40], 6)
    recorder = EagerRecorder()
    replayed = split_greedy(stages(snapshot, Precision.FLOAT32, recorder), PROMPT[:40], 6)
    assert recorder.captures == 0
    assert replayed[0] == eager[0]
    assert all(torch.equal(a, b) for a, b in zip(replayed[1], eager[1], strict=True))


@pytest.mark.parametrize("precision", [Precision.BFLOAT16, Precision.FLOAT32], ids=str)
def test_batched_steps_between_replays_write_the_same_buffers(tiny_snapshot, precision):
    """Sessions decoded one at a time, then batched, in turn, each replayed (a batch of
    distinct sessions is one graph of a row each, over the sessions' own buffers): the
    tokens of stages without graphs; a replay after a batched step needs no new graph."""
    snapshot = tiny_snapshot("llama")
    ranges = ((0, 3), (3, 6))

    def run(recorder, batched_every: int) -> dict[str, list[int]]:
        pair = stages(snapshot, precision, recorder, ranges)
        tokens = {}
        for batched in (False, True) * batched_every:
            for sid, out in decode_sessions(pair, batched, steps=3).items():
                tokens.setdefault(sid, []).extend(out)
        return tokens

    recorder = EagerRecorder()
    assert run(recorder, 2) == run(None, 2)
    # per stage, first run: a graph per session (3), one for the batch of all three (1);
    # second run: IDLE of the closed sessions' lanes were kept with their graphs, so one
    # session needs a graph (1), and the batch of lanes is a new one (1)
    assert recorder.captures == 2 * (3 + 1 + (3 - DecodeGraphs.IDLE) + 1)


def test_verification_passes_and_rewinds_between_replays(tiny_snapshot):
    """Replayed steps, then steps carrying drafts (rows of one pass; a rejected draft cut
    back), in turn: the graphs' buffers take the drafts' rows and the cuts, and greedy
    decoding keeps the tokens of stages without graphs."""
    snapshot = tiny_snapshot("llama")
    reference = split_greedy(stages(snapshot, Precision.FLOAT32), PROMPT, 24)[0]
    recorder = EagerRecorder()
    chain = stages(snapshot, Precision.FLOAT32, recorder)
    for stage in chain:
        stage.open_session("s")
    out = None
    for lo in range(0, len(PROMPT), 128):
        out = chain[0].step("s", lo, token_ids=torch.tensor([PROMPT[lo : lo + 128]]))
        for stage in chain[1:]:
            out = stage.step("s", lo, hidden=out.hidden)
    tokens, position, step = [out.token.token_id], len(PROMPT), 0
    while len(tokens) < len(reference):
        truth = reference[len(tokens) :]
        drafts = draft_plan(step, truth, 256)[: len(truth) - 1] if step % 2 else []
        out = chain[0].step("s", position, token_ids=torch.tensor([[tokens[-1], *drafts]]),
                            drafts=tuple(drafts))  # fmt: skip
        for stage in chain[1:]:
            out = stage.step("s", position, hidden=out.hidden, drafts=tuple(drafts))
        got = [out.token.token_id, *(t.token_id for t in out.more or ())]
        tokens.extend(got)
        position += len(got)
        step += 1
    assert tokens[: len(reference)] == reference
    assert recorder.captures == 3 * 2  # first step, past 256: drafts stayed in the buffers


def test_a_rejected_guess_keeps_the_lane(tiny_snapshot):
    """A guess step replayed, then the step that replaces it at the same position: the
    rewind's crop leaves 424 spare positions in a lane of 1024 (a grown buffer gives more
    than 256 back), yet the lane keeps its buffers and the replay needs no new graph."""
    snapshot = tiny_snapshot("llama")
    recorder = EagerRecorder()
    stage = stages(snapshot, Precision.FLOAT32, recorder, ((0, 6),))[0]
    plain = stages(snapshot, Precision.FLOAT32, None, ((0, 6),))[0]
    prompt = (PROMPT * 3)[:600]
    outs = []
    for node in (stage, plain):
        node.open_session("s")
        for lo in range(0, len(prompt), 128):
            out = node.step("s", lo, token_ids=torch.tensor([prompt[lo : lo + 128]]))
        guess = node.step("s", 600, token_ids=torch.tensor([[7]]), guess_from=600)
        real = node.step("s", 600, token_ids=torch.tensor([[out.token.token_id]]))
        outs.append((guess.logits, real.logits))
    lanes = stage.graphs._lanes
    (lane,) = list(lanes.values())
    assert lane.capacity == 1024 and recorder.captures == 1
    assert stage.sessions.get("s").cache.layers[0]._key_buffer is lane.keys[0]
    for replayed, eager in zip(*outs, strict=True):
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)


def test_a_closed_sessions_graph_serves_the_next_session(tiny_snapshot):
    """Requests one after another capture once: the next session copies its positions into
    the closed one's buffers (the rest zeroed), with the tokens of a stage without graphs."""
    snapshot = tiny_snapshot("llama")
    recorder = EagerRecorder()
    stage = stages(snapshot, Precision.FLOAT32, recorder, ((0, 6),))[0]
    plain = stages(snapshot, Precision.FLOAT32, None, ((0, 6),))[0]
    for n in (60, 30, 90):
        assert split_greedy([stage], PROMPT[:n], 4)[0] == split_greedy([plain], PROMPT[:n], 4)[0]
    assert recorder.captures == 1
    gc.collect()
    assert len(stage.graphs._lanes) == 0  # the last session's lane waits for the next


def test_a_capture_that_fails_leaves_the_steps_as_they_were(tiny_snapshot, caplog):
    class Failing:
        def capture(self, body):
            raise RuntimeError("operation not permitted when stream is capturing")

    snapshot = tiny_snapshot("llama")
    eager = split_greedy(stages(snapshot, Precision.FLOAT32), PROMPT[:40], 6)
    with caplog.at_level(logging.WARNING, logger="meshnet_node.programs.graphs"):
        tried = stages(snapshot, Precision.FLOAT32, Failing())
        out = split_greedy(tried, PROMPT[:40], 6)
    assert out[0] == eager[0]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out[1], eager[1], strict=True))
    assert all(stage.graphs.broken for stage in tried)
    assert "cannot be captured" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", [Precision.BFLOAT16, Precision.INT4], ids=str)
def test_cuda_graphs_give_the_eager_stages_tokens(tiny_snapshot, precision):
    snapshot = tiny_snapshot("llama")
    device = "cuda"
    eager = split_greedy(stages(snapshot, precision, None, device=device), PROMPT, 20)
    recorder = CudaRecorder(torch.device(device))
    replayed = split_greedy(stages(snapshot, precision, recorder, device=device), PROMPT, 20)
    assert replayed[0] == eager[0]
    whole = split_greedy(stages(snapshot, precision, recorder, ((0, 6),), device), PROMPT, 20)
    assert all(torch.equal(a, b) for a, b in zip(replayed[1], whole[1], strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_of_batched_steps_give_the_eager_stages_tokens(tiny_snapshot):
    snapshot = tiny_snapshot("llama")
    ranges = ((0, 3), (3, 6))
    eager = stages(snapshot, Precision.BFLOAT16, None, ranges, "cuda")
    graphed = stages(
        snapshot, Precision.BFLOAT16, CudaRecorder(torch.device("cuda")), ranges, "cuda"
    )
    for batched in (False, True, True):
        assert decode_sessions(graphed, batched, steps=6) == decode_sessions(
            eager, batched, steps=6
        )
