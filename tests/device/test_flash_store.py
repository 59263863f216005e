"""The flash layout: conversion, O_DIRECT reads, corrupt inputs, DRAM budget."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import msgspec
import pytest
import torch

from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.hf import load_hf
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.device.budget import minimum_budget, plan_residency, spread_streamed_layers
from lever_actors.device.flash import FlashStore
from lever_actors.device.manifest import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    WEIGHTS_NAME,
    read_manifest,
)
from lever_actors.device.reads import AlignedBuffer
from lever_actors.errors import CheckpointError, ConfigError
from lever_actors.sizes import parse_bytes
from tests.tiny_hf import save_tiny, tiny_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_tiny(tiny_model("qwen2", layers=4), tmp_path_factory.mktemp("hf") / "qwen2")


@pytest.fixture
def layout(hf_dir, tmp_path) -> Path:
    convert(hf_dir, tmp_path / "flash", torch.float64)
    return tmp_path / "flash"


def test_layout_round_trips_every_tensor(hf_dir, layout):
    original = load_hf(hf_dir, torch.float64).weights
    store = FlashStore(layout, verify=True)
    manifest = store.manifest
    assert all(e.offset % 4096 == 0 and e.nbytes % 4096 == 0 for e in manifest.extents)
    for i, layer in enumerate(original.layers):
        got = store.load_extent(manifest.layer(i))
        assert got.keys() == layer.keys()
        for name, tensor in layer.items():
            assert torch.equal(got[name], tensor), (i, name)
    assert torch.equal(store.load_extent(manifest.extent("lm_head"))["lm_head"], original.lm_head)
    rows = store.read_rows(manifest.extent("embed"), [5, 0, 96])
    assert torch.equal(rows, original.embed[[5, 0, 96]])


def test_extents_loaded_together_equal_each_loaded_alone(layout):
    store = FlashStore(layout)
    extents = list(store.manifest.extents)
    alone = [store.load_extent(e) for e in extents]
    read = store.stats.bytes_read
    together = store.load_extents(extents)
    assert store.stats.bytes_read - read == sum(e.nbytes for e in extents) == read
    for one, other in zip(alone, together, strict=True):
        assert one.keys() == other.keys()
        assert all(torch.equal(one[name], other[name]) for name in one)


def test_reads_bypass_the_page_cache(layout):
    store = FlashStore(layout)
    assert store.mode == "o_direct"  # /tmp here is ext4, which takes O_DIRECT


def test_refused_o_direct_falls_back_to_buffered_reads(layout, monkeypatch):
    real_open = os.open

    def refuse_direct(path, flags, *args):
        # what tmpfs on older kernels and some overlays answer
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    store = FlashStore(layout)
    assert store.mode == "buffered+fadvise_dontneed"
    extent = store.manifest.layer(0)
    got = store.read_extent(extent, AlignedBuffer(extent.nbytes))
    monkeypatch.undo()
    expected = FlashStore(layout).load_extent(extent)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_convert_refuses_existing_output_and_leaves_no_partial(hf_dir, layout):
    with pytest.raises(CheckpointError, match="already exists"):
        convert(hf_dir, layout, torch.float64)
    assert [p.name for p in layout.parent.iterdir()] == ["flash"]


def test_truncated_weights_file_names_file_and_tensor(layout):
    weights = layout / WEIGHTS_NAME
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(
        CheckpointError,
        match=r"weights\.bin: tensor '\w+' of [\w.]+ ends at byte \d+, past the end",
    ):
        FlashStore(layout)


def test_manifest_of_another_version(layout):
    path = layout / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["version"] = 99
    path.write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointError,
        match=rf"manifest version 99, this lever_actors reads version {MANIFEST_VERSION}",
    ):
        read_manifest(layout)


def test_manifest_pointing_past_the_end(layout):
    path = layout / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    extent = next(e for e in manifest["extents"] if e["key"] == "layer.1")
    extent["tensors"][2]["offset"] += 10**9
    path.write_text(json.dumps(manifest))
    name = extent["tensors"][2]["name"]
    with pytest.raises(
        CheckpointError, match=rf"tensor '{name}' of layer\.1 ends at byte \d+, past the end"
    ):
        FlashStore(layout)


def test_budget_below_minimum_states_the_minimum(layout):
    manifest = read_manifest(layout)
    minimum = minimum_budget(manifest)
    plan_residency(manifest, minimum)  # exactly the minimum is fine
    with pytest.raises(
        ConfigError, match=rf"below the minimum .*\({minimum} bytes\): LM head \+ final norm"
    ):
        plan_residency(manifest, minimum - 1)


def testspread_streamed_layers_spread_through_the_pass_and_fall_back_to_the_last_ones():
    equal = [10] * 28
    assert spread_streamed_layers(equal, 250) == [8, 18, 27]  # 25 fit beside the ring
    assert spread_streamed_layers(equal, 280) == []
    assert spread_streamed_layers(equal, 0) == list(range(28))
    # unequal sizes: spread, layer 2 (30) would be kept where only layers 0 and 1 (20) fit
    assert spread_streamed_layers([10, 10, 30, 10], 25) == [2, 3]


def test_budget_plans(layout):
    manifest = read_manifest(layout)
    everything = manifest.file_bytes
    full = plan_residency(manifest, everything)
    assert full.streamed_layers == () and full.ring_slots == 0 and not full.embed_rows_on_demand
    least = plan_residency(manifest, minimum_budget(manifest))
    assert least.streamed_layers == (0, 1, 2, 3) and least.embed_rows_on_demand
    mixed = plan_residency(manifest, minimum_budget(manifest) + manifest.layer(0).nbytes)
    # the streamed layers spread through the pass, each ending an equal run
    assert mixed.streamed_layers == (0, 2, 3) and "layer.1" in mixed.resident
    # every layer and the head, not the embedding table: its rows are read as tokens need them
    embed = manifest.extent("embed").nbytes
    no_table = plan_residency(manifest, everything - embed)
    assert no_table.streamed_layers == () and no_table.embed_rows_on_demand
    for plan in (full, least, mixed, no_table):
        assert plan.used(manifest) <= plan.budget


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1.5GiB", 3 * 2**29), ("800MB", 800 * 10**6), ("123", 123), ("4 KiB", 4096)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_nonsense():
    with pytest.raises(ConfigError, match="cannot read 'lots' as a size"):
        parse_bytes("lots")


def test_manifest_is_msgspec_validated(layout):
    path = layout / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["extents"][0]["offset"] = "zero"
    path.write_bytes(msgspec.json.encode(manifest))
    with pytest.raises(CheckpointError, match="invalid manifest"):
        read_manifest(layout)


def test_load_checkpoint_reads_a_whole_layout(hf_dir, layout):
    original = load_hf(hf_dir, torch.float64)
    loaded = load_checkpoint(layout, torch.float64)
    assert loaded.args == original.args
    for ours, theirs in zip(loaded.weights.layers, original.weights.layers, strict=True):
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert torch.equal(loaded.weights.embed, original.weights.embed)
    assert torch.equal(loaded.weights.lm_head, original.weights.lm_head)


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(part, 16) for part in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_read_buffer_is_private_memory_advised_for_huge_pages():
    big, small = AlignedBuffer(8 << 20), AlignedBuffer(4096)
    big.array[::4096] = 1  # touched, as a read would
    flags = _vm_flags(big.array.ctypes.data)
    assert "sh" not in flags and "hg" in flags  # an O_DIRECT read pins huge pages, not 4 KiB
    assert "hg" not in _vm_flags(small.array.ctypes.data)  # below one huge page: no advice
