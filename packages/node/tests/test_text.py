"""Incremental detokenization: stop strings across tokens, partial UTF-8, hold-back, and
per-token work that does not grow with the length of the output."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from meshnet_node.head.text import TextAssembler

MIXED = (
    "Hello, world! Ça va? Façade, naïve résumé, Ångström. 日本語のテキストと中文字符。"
    " Emoji: 🎉🚀 👩‍👩‍👧 🇫🇷 ok.\ndef f(x):\n    return x ** 2  # 🐍 — done\n\n"
)


class CountingTokenizer:
    """A tokenizer seen through ``decode`` only (no ``_tokenizer`` unless given one), which
    counts the calls and the ids they decode."""

    def __init__(self, tokenizer, *, backend=None) -> None:
        self.inner = tokenizer
        if backend is not None:
            self._tokenizer = backend
        self.calls = 0
        self.ids_decoded: list[int] = []  # ids per call

    def decode(self, ids, skip_special_tokens=False) -> str:
        self.calls += 1
        self.ids_decoded.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def byte_fallback() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer: letters, and bytes for everything else."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for char in "▁abcdefghijklmnopqrstuvwxyz!#":
        vocab.setdefault(char, len(vocab))
    merges = [("▁", "h"), ("▁h", "e")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def smollm2(smollm2_snapshot):
    return AutoTokenizer.from_pretrained(smollm2_snapshot)


@pytest.fixture(params=["stream", "window"])
def path(request) -> str:
    """Run a test through DecodeStream and through the windowed-decode fallback."""
    return request.param


def as_path(tokenizer, path: str):
    return tokenizer if path == "stream" else CountingTokenizer(tokenizer)


def feed(assembler: TextAssembler, ids: list[int]) -> tuple[list[str], int | None]:
    """Deltas for each token, and the index of the token that hit a stop (None: none)."""
    deltas = []
    for i, token in enumerate(ids):
        delta, stopped = assembler.add(token)
        deltas.append(delta)
        if stopped:
            return deltas, i
    return deltas, None


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_both_paths_are_taken(byte_fallback):
    assert TextAssembler(byte_fallback, ()).decoder.streaming
    assert not TextAssembler(CountingTokenizer(byte_fallback), ()).decoder.streaming


def test_a_stop_string_across_tokens_returns_the_text_before_it(byte_fallback, path):
    tok = as_path(byte_fallback, path)
    ids = encode(byte_fallback, "he said é ok")  # "é" is two byte tokens
    assembler = TextAssembler(tok, ["id é"])
    deltas, at = feed(assembler, ids)
    assert at == ids.index(byte_fallback.convert_tokens_to_ids("<0xA9>"))  # é's last byte
    assert "".join(deltas) == "he sa"
    assert assembler.stopped and assembler.text == "he sa"
    assert assembler.finish() == ""
    assert assembler.add(ids[0]) == ("", True)


def test_text_held_back_before_a_stop_comes_out_with_the_stopping_token(byte_fallback, path):
    tok = as_path(byte_fallback, path)
    ids = encode(byte_fallback, "he said so")
    deltas, at = feed(TextAssembler(tok, ["said!", "d "]), ids)
    assert at == 6  # the "▁" after "said"
    assert deltas[-1] == "sai"  # "said" was held for "said!"; "d " cuts it
    assert "".join(deltas) == "he sai"


def test_text_that_could_begin_a_stop_is_held_back_and_released_when_it_cannot(byte_fallback, path):
    tok = as_path(byte_fallback, path)
    ids = encode(byte_fallback, "he said so")
    assert byte_fallback.convert_ids_to_tokens(ids) == [
        "▁he", "▁", "s", "a", "i", "d", "▁", "s", "o",
    ]  # fmt: skip
    deltas, at = feed(TextAssembler(tok, ["said!", "#"]), ids)
    assert at is None
    # "s", "sa", "sai", "said" could each become "said!": held; " " ends that chance
    # (and "s" again, until "o").
    assert deltas == ["he", " ", "", "", "", "", "said ", "", "so"]


def test_finish_flushes_the_held_back_text(byte_fallback, path):
    tok = as_path(byte_fallback, path)
    assembler = TextAssembler(tok, ["said!"])
    deltas, _ = feed(assembler, encode(byte_fallback, "he said"))
    assert "".join(deltas) == "he "
    assert assembler.finish() == "said"
    assert assembler.finish() == ""


def test_partial_utf8_over_byte_fallback_tokens_never_reaches_a_delta(byte_fallback, path):
    tok = as_path(byte_fallback, path)
    text = "a 日本 🎉 é b"
    ids = encode(byte_fallback, text)
    deltas, _ = feed(TextAssembler(tok, ()), ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == text
    three = [byte_fallback.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "日".encode()]
    start = ids.index(three[0])
    assert ids[start : start + 3] == three
    assert deltas[start : start + 3] == ["", "", "日"]


def test_an_unfinished_character_at_the_end_is_dropped(byte_fallback, path):
    tok = as_path(byte_fallback, path)
    ids = encode(byte_fallback, "ab 🎉")[:-2]  # the emoji's last two bytes never come
    assembler = TextAssembler(tok, ["zz"])
    deltas, _ = feed(assembler, ids)
    assert "".join(deltas) + assembler.finish() == "ab "


def test_a_stop_before_an_unfinished_character_stops_at_that_token(smollm2, path):
    tok = as_path(smollm2, path)
    ids = encode(smollm2, "x 🎉 y")
    assert smollm2.convert_ids_to_tokens(ids)[1] == "ĠðŁ"  # " " and half the emoji
    assembler = TextAssembler(tok, ["x "])
    deltas, at = feed(assembler, ids)
    assert at == 1
    assert "".join(deltas) + assembler.finish() == ""


@pytest.mark.parametrize("source", ["mixed", "random ids"], ids=["mixed text", "random ids"])
def test_deltas_equal_a_full_decode_over_a_long_generation(smollm2, path, source):
    tok = as_path(smollm2, path)
    if source == "mixed":
        ids = encode(smollm2, MIXED * 40)
    else:  # specials, stray continuation bytes, anything a sampler might produce
        rng = random.Random(14)
        ids = [rng.randrange(len(smollm2)) for _ in range(3000)]
    assert len(ids) > 2000
    assembler = TextAssembler(tok, ())
    deltas, at = feed(assembler, ids)
    assert at is None
    full = smollm2.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) + assembler.finish() == full.rstrip("\ufffd")
    if source == "mixed":
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("stop", ["###", "\n\n", "中文", "🐍 —"])
def test_stops_match_cutting_the_full_decode(smollm2, path, stop):
    tok = as_path(smollm2, path)
    ids = encode(smollm2, "prefix " * 300 + MIXED + "### tail\n\n")
    assembler = TextAssembler(tok, [stop, "never appears"])
    deltas, at = feed(assembler, ids)
    assert at is not None
    full = smollm2.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) + assembler.finish() == full[: full.index(stop)]
    # it stopped at the first token whose text completes the stop string
    assert stop not in smollm2.decode(ids[:at], skip_special_tokens=True)
    assert stop in smollm2.decode(ids[: at + 1], skip_special_tokens=True)


def test_per_token_work_does_not_grow_with_the_length_of_the_output(smollm2):
    ids = encode(smollm2, MIXED * 60)
    assert len(ids) > 3000

    window = CountingTokenizer(smollm2)  # the fallback: decode calls on a bounded window
    feed(TextAssembler(window, ["###!", "never appears"]), ids)
    assert window.calls <= 4 * len(ids)
    assert max(window.ids_decoded) <= 8  # one character is at most 4 byte tokens, twice
    half = len(window.ids_decoded) // 2
    assert sum(window.ids_decoded[half:]) <= 1.2 * sum(window.ids_decoded[:half])

    stream = CountingTokenizer(smollm2, backend=smollm2._tokenizer)  # DecodeStream
    assembler = TextAssembler(stream, ())
    assert assembler.decoder.streaming
    feed(assembler, ids)
    assert stream.calls == 0  # nothing is ever decoded again through the tokenizer
    assert len(assembler._pending) == 0  # no stop strings: nothing is held back


def test_held_back_text_stays_shorter_than_the_longest_stop(smollm2):
    ids = encode(smollm2, MIXED * 20)
    stops = ["#" * 12, "never appears"]
    assembler = TextAssembler(smollm2, stops)
    for token in ids:
        assembler.add(token)
        assert len(assembler._pending) < max(len(s) for s in stops)


HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>")


@pytest.fixture(scope="module")
def structured():
    """Two tokenizers in the style of the MoE families: gpt-oss's harmony (structure in
    special tokens) and Qwen3 / DeepSeek-R1 (``<think>`` as an ordinary added token)."""
    from meshnet_common.tiny.snapshots import build_tokenizer

    harmony = build_tokenizer()
    harmony.add_special_tokens({"additional_special_tokens": list(HARMONY)})
    thinking = build_tokenizer()
    thinking.add_tokens(["<think>", "</think>"])
    return harmony, thinking


def _assemble(tokenizer, text: str, **kwargs) -> str:
    assembler = TextAssembler(tokenizer, [], **kwargs)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return "".join(assembler.add(i)[0] for i in ids) + assembler.finish()


def test_structural_special_tokens_survive_by_default(structured):
    """A harmony reply keeps its channels (a client parses analysis from final); other models
    drop special tokens, as vLLM does by default."""
    from meshnet_node.head.text import skips_special_tokens

    harmony, thinking = structured
    reply = "<|channel|>analysis<|message|>The user asks.<|end|><|start|>assistant" \
        "<|channel|>final<|message|>Paris.<|return|>"  # fmt: skip
    assert skips_special_tokens(harmony) is False and skips_special_tokens(thinking) is True
    assert _assemble(harmony, reply, skip_special_tokens=False) == reply
    assert _assemble(harmony, reply) == "analysisThe user asks.assistantfinalParis."
    think = "<think>The user asks.</think>Paris."
    assert _assemble(thinking, think) == think  # not special: kept even when skipping


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_reasoning_is_split_from_content_in_any_cut(parser):
    from meshnet_node.head.text import ReasoningSplitter

    reply = "<think>The user wants a city.\nRome fits.</think>\n\nRome."
    # the content keeps what follows </think> as it is (as vLLM's parsers)
    assert ReasoningSplitter(parser).split(reply) == ("The user wants a city.\nRome fits.",
                                                      "\n\nRome.")  # fmt: skip
    for cut in range(1, len(reply)):  # tags split across stream deltas
        splitter = ReasoningSplitter(parser)
        parts = [splitter.feed(reply[:cut]), splitter.feed(reply[cut:], final=True)]
        assert "".join(r for r, _ in parts) == "The user wants a city.\nRome fits."
        assert "".join(c for _, c in parts) == "\n\nRome."
    opened_by_template = "It is Rome.</think>Rome."  # the prompt ended with <think>
    expected = ("It is Rome.", "Rome.") if parser == "deepseek_r1" else (None, opened_by_template)
    assert ReasoningSplitter(parser).split(opened_by_template) == expected
    assert ReasoningSplitter("qwen3").split("Just Rome.") == (None, "Just Rome.")
