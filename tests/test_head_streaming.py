"""A DRAM budget too small for the LM head beside the ring of layer slots streams the head
from flash, once per target pass, in blocks of whole HEAD_ROWS rows, and the tokens stay
exactly sequential decoding's: the head multiplies in the same blocks whether resident or
streamed."""

from __future__ import annotations

import shutil
import time

import msgspec
import pytest
import torch

from lever_actors.config import EngineConfig
from lever_actors.device.budget import head_resident_budget, minimum_budget, plan_residency
from lever_actors.device.flash import FlashStore
from lever_actors.device.manifest import read_manifest
from lever_actors.device.reads import AlignedBuffer
from lever_actors.engine import Engine
from lever_actors.errors import ConfigError, CorruptLayoutError
from lever_actors.model.layers import HEAD_ROWS
from lever_actors.target import FlashTarget
from lever_actors.testing import TWIN_GAP, assert_matches_sequential, bf16_args, model_pair
from tests.reliability.test_integrity import flip_byte, tensor_start

VOCAB = 2 * HEAD_ROWS + 808  # three blocks, the last one short
PROMPT = [17, 8200, 17, 8200, 17, 8200]


def streamed_pair(weights: str = "dense", dtype: torch.dtype = torch.bfloat16):
    """bf16_args' model with a vocabulary of three head blocks: its head outgrows a layer."""
    args = msgspec.structs.replace(bf16_args(), vocab_size=VOCAB)
    return model_pair(
        args, "perturbed", 0, scale=0.001, dtype=dtype, twin_gap=TWIN_GAP, weights=weights
    )


def config(weights: str = "dense", **fields) -> EngineConfig:
    pair = streamed_pair(weights)
    manifest = read_manifest(pair.target)
    return EngineConfig(
        target=str(pair.target),
        draft=str(pair.draft),
        dram_budget=minimum_budget(manifest),
        draft_dtype="bfloat16",
        draft_weights=weights,
        **fields,
    )


@pytest.mark.parametrize("weights", ["dense", "q6", "q8"])
def test_the_planner_streams_the_head_only_below_what_holds_it(weights):
    manifest = read_manifest(streamed_pair(weights).target)
    least = plan_residency(manifest, minimum_budget(manifest))
    assert least.head_streamed and "lm_head" not in least.resident
    assert least.head_rows_per_read % HEAD_ROWS == 0
    assert least.used(manifest) <= least.budget
    assert minimum_budget(manifest) < head_resident_budget(manifest)
    held = plan_residency(manifest, head_resident_budget(manifest))
    assert not held.head_streamed and "lm_head" in held.resident
    minimum = minimum_budget(manifest)
    with pytest.raises(ConfigError, match=rf"\({minimum} bytes\): LM head's read buffer \+"):
        plan_residency(manifest, minimum - 1)


@pytest.mark.parametrize("weights", ["dense", "q6", "q8"])
def test_streamed_rows_are_the_stored_head(weights):
    layout = streamed_pair(weights).target
    store = FlashStore(layout)
    extent = store.manifest.extent("lm_head")
    whole = store.load_extent(extent)["lm_head"]
    manifest = store.manifest
    plan = plan_residency(manifest, minimum_budget(manifest))
    buffer = AlignedBuffer(plan.head_buffer_bytes)
    starts = []
    for part in store.stream_rows(extent, plan.head_rows_per_read, buffer):
        lo = sum(starts)
        starts.append(part.shape[0])
        if weights == "dense":
            assert torch.equal(part, whole[lo : lo + part.shape[0]])
        else:
            assert torch.equal(part.data, whole.data[lo : lo + part.shape[0]])
            assert torch.equal(part.scales, whole.scales[lo : lo + part.shape[0]])
    assert sum(starts) == VOCAB and len(starts) == 3


def test_the_next_part_is_read_while_one_is_used_and_an_early_stop_waits_for_it(monkeypatch):
    store = FlashStore(streamed_pair("q8").target)
    manifest = store.manifest
    plan = plan_residency(manifest, minimum_budget(manifest))
    read_into = FlashStore._read_into

    def slow(self, *args):
        time.sleep(0.2)
        read_into(self, *args)

    monkeypatch.setattr(FlashStore, "_read_into", slow)
    buffer = AlignedBuffer(plan.head_buffer_bytes)
    parts = store.stream_rows(manifest.extent("lm_head"), plan.head_rows_per_read, buffer)
    next(parts)
    deadline = time.monotonic() + 10
    while store.stats.reads < 3 and time.monotonic() < deadline:  # the caller's work on part 0
        time.sleep(0.01)
    assert store.stats.reads == 3  # the scales, part 0, and part 1 while part 0 was in use
    next(parts)
    parts.close()  # part 2 is being read into part 0's half: close waits for it
    assert store.stats.reads == 4


@pytest.mark.parametrize("weights", ["dense", "q6", "q8"])
@pytest.mark.parametrize("tree", ["gaincost", "static:8,8", "none"])
async def test_a_streamed_head_decodes_exactly_as_one_token_decoding(weights, tree):
    await assert_matches_sequential(config(weights, tree=tree), PROMPT, 20)


async def test_each_step_reads_the_head_once(monkeypatch):
    reads = []
    stream_rows = FlashStore.stream_rows

    def counted(self, *args):
        reads.append(args)
        return stream_rows(self, *args)

    async with Engine.open(config(tree="gaincost")) as engine:
        monkeypatch.setattr(FlashStore, "stream_rows", counted)
        result = await engine.generate(PROMPT, max_new_tokens=12)
    assert len(reads) == len(result.steps)
    # the prompt's pass projects its last token only; later ones every node past it
    assert result.steps[0].projected_nodes == 1 + result.steps[0].tree_nodes - len(PROMPT)


def test_logits_from_a_streamed_head_equal_a_resident_one():
    layout = streamed_pair("q8").target
    manifest = read_manifest(layout)
    streamed = FlashTarget(layout, plan_residency(manifest, minimum_budget(manifest)))
    resident = FlashTarget(layout, plan_residency(manifest, manifest.file_bytes))
    hidden = torch.randn(5, manifest.args.d_model, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(torch.bfloat16)
    assert streamed.lm_head is None and resident.lm_head is not None
    assert torch.equal(streamed.logits(hidden), resident.logits(hidden))


async def test_early_exit_needs_the_head_in_dram():
    with pytest.raises(ConfigError, match="early_exit 'lens' needs the LM head in DRAM"):
        async with Engine.open(config(tree="gaincost", early_exit="lens")):
            pass
    async with Engine.open(config(tree="gaincost")) as engine:  # auto: no pruning
        assert engine.policies.predictor == "off"


async def test_a_corrupt_head_byte_stops_the_step(tmp_path):
    layout = tmp_path / "layout"
    shutil.copytree(streamed_pair("q8").target, layout)
    flip_byte(layout, tensor_start(layout, "lm_head", "lm_head") + HEAD_ROWS * 512 + 3)
    manifest = read_manifest(layout)
    plain = EngineConfig(target=str(layout), dram_budget=minimum_budget(manifest), tree="none")
    with pytest.raises(CorruptLayoutError, match="tensor 'lm_head'"):
        async with Engine.open(plain) as engine:
            await engine.generate(PROMPT, max_new_tokens=2)
