"""Fuzz the GGUF reader: random bytes in a valid tiny file's header (metadata and tensor
table), and random types and values for its metadata fields. Every case ends in a
CheckpointError or in a checkpoint whose shapes agree with its args; nothing else."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGUFValueType as V
from hypothesis import given
from hypothesis import strategies as st

from lever_actors.checkpoints.gguf_file import load_gguf
from tests.reliability.fuzz import examples, load_or_refuse
from tests.reliability.tiny import gguf_metadata, gguf_tensors, write_gguf

INT_RANGES = {
    V.UINT8: (0, 2**8 - 1),
    V.INT8: (-(2**7), 2**7 - 1),
    V.UINT16: (0, 2**16 - 1),
    V.INT16: (-(2**15), 2**15 - 1),
    V.UINT32: (0, 2**32 - 1),
    V.INT32: (-(2**31), 2**31 - 1),
    V.UINT64: (0, 2**64 - 1),
    V.INT64: (-(2**63), 2**63 - 1),
}
# keys the reader or the tokenizer reads beyond those the tiny file has
EXTRA_KEYS = [
    "general.alignment",
    "qwen2.rope.scaling.type",
    "qwen2.rope.scaling.factor",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.add_bos_token",
]
KEYS = sorted(gguf_metadata()) + EXTRA_KEYS


def _ints(kind: V) -> st.SearchStrategy[int]:
    lo, hi = INT_RANGES[kind]
    return st.integers(max(lo, -3), min(hi, 40)) | st.integers(lo, hi)  # near the real sizes too


def _scalars(kind: V) -> st.SearchStrategy:
    if kind in INT_RANGES:
        return _ints(kind)
    if kind == V.FLOAT32:
        return st.floats(width=32)
    if kind == V.FLOAT64:
        return st.floats()
    if kind == V.BOOL:
        return st.booleans()
    plausible = st.sampled_from(["qwen2", "llama", "gpt2", "linear", "none", "a b"])
    return plausible | st.text(max_size=8) | st.binary(max_size=8)  # bytes: maybe not UTF-8


SCALAR_KINDS = [*INT_RANGES, V.FLOAT32, V.FLOAT64, V.BOOL, V.STRING]


@st.composite
def gguf_values(draw: st.DrawFn) -> tuple:
    """(value, type, array element type) for GGUFWriter.add_key_value."""
    kind = draw(st.sampled_from([*SCALAR_KINDS, V.ARRAY]))
    if kind != V.ARRAY:
        return draw(_scalars(kind)), kind, None
    sub_type = draw(st.sampled_from(SCALAR_KINDS))
    return draw(st.lists(_scalars(sub_type), min_size=1, max_size=4)), kind, sub_type


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-fuzz")


@pytest.fixture(scope="module")
def base(workdir: Path) -> tuple[bytes, int]:
    """The valid file's bytes and where its header (everything before the data) ends."""
    path = write_gguf(workdir / "base.gguf", gguf_metadata(), gguf_tensors())
    return path.read_bytes(), gguf.GGUFReader(path).data_offset


@examples(0.4)
@given(
    edits=st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.none() | st.integers(0, 2**20),
)
def test_random_header_bytes(workdir: Path, base: tuple[bytes, int], edits, cut) -> None:
    data, header_end = base
    mutated = bytearray(data)
    for at, byte in edits:
        mutated[at % header_end] = byte
    if cut is not None:
        mutated = mutated[: cut % header_end]
    path = workdir / "mutated.gguf"
    path.write_bytes(bytes(mutated))
    load_or_refuse(lambda: load_gguf(path, torch.float64))


@examples(0.4)
@given(changes=st.dictionaries(st.sampled_from(KEYS), st.none() | gguf_values(), max_size=4))
def test_random_metadata_values(workdir: Path, changes: dict) -> None:
    metadata = gguf_metadata()
    for key, value in changes.items():
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    path = write_gguf(workdir / "fields.gguf", metadata, gguf_tensors())
    load_or_refuse(lambda: load_gguf(path, torch.float64))
