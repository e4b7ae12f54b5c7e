"""Property tests of how shard requests are parsed and served: HTTP ``Range`` headers, the
arguments of ``ShardServer.source``, and byte ranges of the generated subset files.

The contract: malformed input raises ``InvalidRequest`` (400) or ``NotFound`` (404) and
nothing else; valid input gives exactly the bytes a plain slice of the whole file gives.
"""

from __future__ import annotations

import hashlib
import re
import string
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load as load_safetensors

from meshnet_common.errors import InvalidRequest, NotFound, RangeNotSatisfiable
from meshnet_common.layers import LayerRange
from meshnet_common.models import byte_parts
from meshnet_common.models.checkpoint import INDEX_FILE, CheckpointIndex
from meshnet_common.models.models_dir import resolve_snapshot
from meshnet_common.models.shardfiles import SUBSET_FILE, ShardSource, SubsetFile
from meshnet_common.web.shards import ShardServer, _parse_range

FULL = "meshnet-tiny/llama"  # 6 layers
HALF = "meshnet-tiny/half"  # a subset snapshot holding layers [0, 3) of FULL
NUM_LAYERS = 6
HALF_END = 3
ID_PART = re.compile(r"[A-Za-z0-9._-]+")

PROPERTY = settings(max_examples=200, deadline=None)


# -- Range headers -------------------------------------------------------------------------

sizes = st.integers(1, 10**12)


@PROPERTY
@given(data=st.data(), size=sizes, open_ended=st.booleans())
def test_parse_range_round_trips(data, size: int, open_ended: bool) -> None:
    """``bytes=a-b`` gives ``[a, min(b + 1, size))``; ``bytes=a-`` gives ``[a, size)``."""
    start = data.draw(st.integers(0, size - 1), label="start")
    if open_ended:
        header, expected = f"bytes={start}-", (start, size)
    else:
        last = data.draw(st.integers(start, size + 10**6), label="last")
        header, expected = f"bytes={start}-{last}", (start, min(last + 1, size))
    assert _parse_range(header, size) == expected


@pytest.mark.parametrize("header", [None, ""])
def test_parse_range_absent(header) -> None:
    assert _parse_range(header, 10) is None


@pytest.mark.parametrize(
    ("header", "expected"), [("bytes=-5", (95, 100)), ("bytes=-500", (0, 100))]
)
def test_parse_range_suffix(header: str, expected) -> None:
    assert _parse_range(header, 100) == expected


@pytest.mark.parametrize(
    ("header", "size"), [("bytes=100-", 100), ("bytes=0-", 0), ("bytes=-0", 9)]
)
def test_parse_range_past_the_end_is_416(header: str, size: int) -> None:
    with pytest.raises(RangeNotSatisfiable) as caught:
        _parse_range(header, size)
    assert caught.value.status == 416
    assert caught.value.headers == {"content-range": f"bytes */{size}"}


@st.composite
def unsatisfiable_ranges(draw) -> tuple[str, int]:
    """Well-formed single ranges that do not fit the file: start past the end, or end
    before start."""
    size = draw(st.integers(0, 10**9))
    if draw(st.booleans()):
        start = draw(st.integers(size, size + 10**6))
        last = draw(st.one_of(st.none(), st.integers(start, start + 10)))
    else:
        start = draw(st.integers(1, 10**9))
        last = draw(st.integers(0, start - 1))
    return f"bytes={start}-{'' if last is None else last}", size


@PROPERTY
@given(case=unsatisfiable_ranges())
def test_parse_range_refuses_ranges_outside_the_file(case) -> None:
    header, size = case
    with pytest.raises(InvalidRequest):
        _parse_range(header, size)


@pytest.mark.parametrize(
    "header",
    [
        "bytes=0-1,2-3",  # several ranges
        "bytes=+5-",  # int() would take these spellings; HTTP does not
        "bytes=5_0-",
        "bytes= 5-",
        "items=0-1",  # another unit
        "bytes=",
        "bytes=-",
        "bytes=a-b",
        "bytes=1-x",
        "bytes=0x10-",
        "bytes=1.5-2",
        "Bytes=0-1",
        "bytes=0-" + "9" * 5000,  # more digits than int() parses
        "bytes 0-1",
    ],
)
def test_parse_range_refuses_malformed(header: str) -> None:
    with pytest.raises(InvalidRequest):
        _parse_range(header, 100)


header_text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="bytes=0123456789-, +_", max_size=30),
    st.builds(
        "bytes={}-{}".format,
        st.one_of(st.integers(-10, 10**13), st.text(max_size=6)),
        st.one_of(st.integers(-10, 10**13), st.text(max_size=6)),
    ),
)


@settings(max_examples=500, deadline=None)
@given(header=header_text, size=st.integers(0, 10**12))
def test_parse_range_only_raises_invalid_request(header: str, size: int) -> None:
    """Any header string: a range inside the file, or InvalidRequest; never another error."""
    try:
        result = _parse_range(header, size)
    except InvalidRequest:
        event("InvalidRequest")
        return
    event("parsed")
    if not header:
        assert result is None
        return
    lo, hi = result
    assert isinstance(lo, int) and isinstance(hi, int)
    assert 0 <= lo < hi <= size


# -- ShardServer.source arguments ----------------------------------------------------------


@pytest.fixture(scope="module")
def shard_models(tiny_snapshot, tmp_path_factory) -> Path:
    """A models dir holding FULL (a link to the tiny llama) and HALF (its layers [0, 3),
    written as a node that fetched them would have them)."""
    root = tmp_path_factory.mktemp("shard-models")
    full = tiny_snapshot("llama")
    (root / "meshnet-tiny").mkdir()
    (root / FULL).symlink_to(full, target_is_directory=True)
    source = ShardSource(CheckpointIndex.load(full), FULL, LayerRange(0, HALF_END), "rev")
    half = root / HALF
    half.mkdir()
    for name in source.files():
        (half / name).write_bytes(b"".join(source.iter_file(name)))
    return root


@pytest.fixture(scope="module")
def server(shard_models: Path) -> ShardServer:
    return ShardServer(lambda model_id: resolve_snapshot(shard_models, model_id))


def _valid_id(model_id) -> bool:
    if not isinstance(model_id, str):
        return False
    parts = model_id.split("/")
    return (
        len(parts) == 2
        and all(ID_PART.fullmatch(p) and p not in (".", "..") and "--" not in p for p in parts)
    )  # fmt: skip


def expected_outcome(model_id, start, end) -> type[Exception] | None:
    """The one outcome the rules allow: None (served), InvalidRequest or NotFound."""
    if not _valid_id(model_id):
        return InvalidRequest
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end):
        return InvalidRequest
    if model_id not in (FULL, HALF):
        return NotFound
    if end > NUM_LAYERS:
        return InvalidRequest
    if model_id == HALF and end > HALF_END:
        return NotFound
    return None


id_chars = string.ascii_letters + string.digits + "._-"
model_ids = st.one_of(
    st.sampled_from([FULL, FULL, HALF, HALF, "meshnet-tiny/nope", "other/llama"]),
    st.sampled_from(
        [
            "",
            "llama",
            "a/b/c",
            "../x",
            "x/..",
            "./x",
            "a--b/c",
            "/meshnet-tiny/llama",
            "meshnet-tiny/llama/",
            "meshnet-tiny\\llama",
            "meshnet-tiny/lla ma",
            "meshnet-tiny/\0",
        ]
    ),
    st.builds("{}/{}".format, st.text(id_chars, max_size=8), st.text(id_chars, max_size=8)),
    st.text(max_size=20),
    st.one_of(st.none(), st.integers(), st.binary(max_size=4), st.lists(st.integers())),
)
bounds = st.one_of(
    st.integers(-2, NUM_LAYERS + 2),
    st.integers(-(2**70), 2**70),
    st.sampled_from([None, 1.0, 2.5, "1", b"1", [1], float("nan")]),
)


windows = st.integers(0, NUM_LAYERS - 1).flatmap(
    lambda start: st.tuples(st.just(start), st.integers(start + 1, NUM_LAYERS + 1))
)
arguments = st.one_of(
    st.tuples(st.sampled_from([FULL, HALF]), windows).map(lambda t: (t[0], *t[1])),
    st.tuples(model_ids, windows).map(lambda t: (t[0], *t[1])),
    st.tuples(model_ids, bounds, bounds),
)


@PROPERTY
@given(args=arguments)
def test_source_arguments(server: ShardServer, args) -> None:
    """Bad ids and ranges raise InvalidRequest, missing models and layers NotFound, and
    nothing else; good ones give the source of exactly that range."""
    model_id, start, end = args
    expected = expected_outcome(model_id, start, end)
    event(expected.__name__ if expected else "served")
    if expected is None:
        src = server.source(model_id, start, end)
        assert src.model_id == model_id
        assert src.layers == LayerRange(start, end)
        held = {src.index.layer_of(n) for n in src.subset.names} - {None}
        assert held == set(range(start, end))
    else:
        with pytest.raises(expected):
            server.source(model_id, start, end)


def test_source_is_cached(server: ShardServer) -> None:
    assert server.source(FULL, 1, 3) is server.source(FULL, 1, 3)
    assert server.source(HALF, 0, 2) is not server.source(FULL, 0, 2)


# -- subset files and their byte ranges ----------------------------------------------------


@pytest.fixture(scope="module")
def llama_index(tiny_snapshot) -> CheckpointIndex:
    return CheckpointIndex.load(tiny_snapshot("llama"))


@pytest.fixture(scope="module")
def full_sources(llama_index: CheckpointIndex) -> dict[tuple[int, int], ShardSource]:
    return {
        (start, end): ShardSource(llama_index, FULL, LayerRange(start, end), "rev")
        for start in range(NUM_LAYERS)
        for end in range(start + 1, NUM_LAYERS + 1)
    }


def _whole(subset: SubsetFile) -> bytes:
    data = b"".join(subset.iter_bytes())
    assert len(data) == subset.size
    return data


def test_subset_file_is_a_safetensors_file_of_those_tensors(
    llama_index: CheckpointIndex, full_sources
) -> None:
    """The oracle for the slicing tests: the whole subset file loads with safetensors and
    holds exactly the range's tensors, bit for bit."""
    for (start, end), src in full_sources.items():
        loaded = load_safetensors(_whole(src.subset))
        assert sorted(loaded) == sorted(llama_index.tensors_for(LayerRange(start, end)))
        for name, tensor in loaded.items():
            info = llama_index.tensors[name]
            with safe_open(llama_index.root / info.file, framework="pt") as fh:
                assert tensor.dtype == fh.get_tensor(name).dtype
                assert tensor.equal(fh.get_tensor(name)), name


offsets = st.one_of(st.integers(0, 600_000), st.integers(0, 200), st.just(0))
chunk_sizes = st.sampled_from([1, 7, 4096, byte_parts.READ_CHUNK])


@PROPERTY
@given(data=st.data(), chunk=chunk_sizes)
def test_subset_iter_bytes_is_a_slice(llama_index: CheckpointIndex, data, chunk: int) -> None:
    """``iter_bytes(start, end)`` of any subset (any tensors, any order) is the slice
    ``[start:end]`` of the whole file, in non-empty chunks of at most ``READ_CHUNK`` bytes
    past the header."""
    names = data.draw(
        st.lists(st.sampled_from(sorted(llama_index.tensors)), unique=True, max_size=12),
        label="names",
    )
    subset = SubsetFile(llama_index, names)
    whole = _whole(subset)
    start = data.draw(st.one_of(offsets, st.integers(0, subset.size + 5)), label="start")
    end = data.draw(
        st.one_of(st.none(), offsets, st.integers(start, max(start, subset.size) + 5)), label="end"
    )
    with mock.patch.object(byte_parts, "READ_CHUNK", chunk):
        chunks = list(subset.iter_bytes(start, end))
    assert b"".join(chunks) == whole[start:end]
    assert all(chunks), "an empty chunk"
    header = len(subset.parts[0].data)
    assert all(len(c) <= max(chunk, header) for c in chunks)


@PROPERTY
@given(data=st.data())
def test_source_iter_file_is_a_slice(full_sources, data) -> None:
    """Every file of a source (subset weights, its index, config and tokenizer files) read
    from ``start`` to ``end`` is the slice of the whole file, and the manifest describes the
    whole file."""
    src = data.draw(st.sampled_from(sorted(full_sources.items())), label="range")[1]
    name = data.draw(st.sampled_from(src.files()), label="file")
    whole = b"".join(src.iter_file(name))
    assert len(whole) == src.size_of(name)
    entry = next(f for f in src.manifest()["files"] if f["name"] == name)
    assert entry["size"] == len(whole)
    assert entry["sha256"] == hashlib.sha256(whole).hexdigest()
    start = data.draw(st.integers(0, len(whole) + 5), label="start")
    end = data.draw(st.one_of(st.none(), st.integers(0, len(whole) + 5)), label="end")
    assert b"".join(src.iter_file(name, start, end)) == whole[start:end]


def test_subset_and_index_names(full_sources) -> None:
    for src in full_sources.values():
        assert src.files()[:2] == [SUBSET_FILE, INDEX_FILE]
