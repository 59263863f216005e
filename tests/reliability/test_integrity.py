"""Corrupted flash weights are never used: every read is checked against its checksum by
default, embedding rows read on demand included, and a mismatch names file, tensor and
offset before any token comes from the bad bytes."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest
import torch

from lever_actors.checkpoints.convert import convert
from lever_actors.cli import main
from lever_actors.config import EngineConfig
from lever_actors.device.budget import minimum_budget
from lever_actors.device.checksums import CHUNK_BYTES
from lever_actors.device.flash import FlashStore
from lever_actors.device.manifest import WEIGHTS_NAME, read_manifest
from lever_actors.engine import Engine
from lever_actors.errors import CorruptLayoutError
from lever_actors.testing.checkpoints import TINY_ARGS, flash_layout, tiny_checkpoint

# an embedding table of three checksum chunks and a bit, so rows straddle chunk borders
ARGS = msgspec.structs.replace(TINY_ARGS, vocab_size=1600, d_model=16)  # 128 B a row in float64
ROW_BYTES = ARGS.d_model * 8
PROMPT = [3, 14, 15, 92]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    layout = tmp_path_factory.mktemp("flash") / "layout"
    convert(tiny_checkpoint(ARGS), layout, torch.float64)
    return layout


@pytest.fixture
def layout(pristine, tmp_path) -> Path:
    copy = tmp_path / "layout"
    shutil.copytree(pristine, copy)
    return copy


def flip_byte(layout: Path, offset: int) -> None:
    with open(layout / WEIGHTS_NAME, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x40]))


def tensor_start(layout: Path, key: str, name: str) -> int:
    extent = read_manifest(layout).extent(key)
    return extent.offset + next(t.offset for t in extent.tensors if t.name == name)


def test_a_flipped_layer_byte_is_caught_by_default(layout):
    start = tensor_start(layout, "layer.1", "w_up")
    flip_byte(layout, start + 3)
    extent = read_manifest(layout).layer(1)
    with pytest.raises(
        CorruptLayoutError,
        match=rf"{WEIGHTS_NAME}: checksum mismatch in tensor 'w_up', \d+ bytes at byte {start} ",
    ):
        FlashStore(layout).load_extent(extent)
    FlashStore(layout, verify=False).load_extent(extent)  # --no-verify reads it as it is


def test_rows_read_on_demand_match_the_table_across_chunk_borders(pristine):
    table = FlashStore(pristine).load_extent(read_manifest(pristine).extent("embed"))["embed"]
    border = CHUNK_BYTES // ROW_BYTES  # the first row of the second chunk
    rows = [0, border - 1, border, 2 * border + 1, ARGS.vocab_size - 1, 7, 7]
    for verify in (True, False):
        got = FlashStore(pristine, verify=verify).read_rows(
            read_manifest(pristine).extent("embed"), rows
        )
        assert torch.equal(got, table[rows]), verify


def test_a_flipped_embedding_byte_is_caught_on_a_row_read(layout):
    border = CHUNK_BYTES // ROW_BYTES
    start = tensor_start(layout, "embed", "embed")
    flip_byte(layout, start + CHUNK_BYTES + 5)  # inside row `border`, in the second chunk
    store = FlashStore(layout)
    extent = store.manifest.extent("embed")
    store.read_rows(extent, [0, border - 1, 2 * border])  # rows of other chunks stay readable
    with pytest.raises(
        CorruptLayoutError,
        match=rf"tensor 'embed', {CHUNK_BYTES} bytes at byte {start + CHUNK_BYTES} ",
    ):
        store.read_rows(extent, [1, border + 1])  # a clean row of the corrupt chunk fails too


@pytest.mark.parametrize("where", ["layer.0", "embed"])
async def test_the_engine_generates_nothing_from_corrupt_bytes(layout, where):
    name = "wq" if where == "layer.0" else "embed"
    flip_byte(layout, tensor_start(layout, where, name) + PROMPT[0] * ROW_BYTES + 1)
    budget = minimum_budget(read_manifest(layout))  # layers and embedding rows stream
    config = EngineConfig(target=str(layout), dram_budget=budget, tree="none")
    events = []
    with pytest.raises(CorruptLayoutError, match=rf"tensor '{name}'"):
        async with Engine.open(config) as engine:
            async for event in engine.stream(PROMPT, max_new_tokens=4):
                events.append(event)
    assert events == []


def test_the_command_refuses_corrupt_weights_unless_told_not_to_check(tmp_path, capsys):
    layout = tmp_path / "layout"
    shutil.copytree(flash_layout(tiny_checkpoint(TINY_ARGS, tokenizer="words")), layout)
    flip_byte(layout, tensor_start(layout, "layer.1", "w_down") + 9)
    command = ["generate", "--target", str(layout), "--prompt", "t1 t2", "--max-new-tokens", "3"]
    assert main(command) == 1
    assert "checksum mismatch in tensor 'w_down'" in capsys.readouterr().err
    assert main([*command, "--no-verify"]) == 0
