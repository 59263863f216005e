"""Flash-offloaded autoregressive decoding (the engine with no drafting) equals the
reference greedy decoder under every kind of DRAM budget, and reads what it should."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import trio

from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.hf import load_hf
from lever_actors.config import EngineConfig
from lever_actors.device.budget import minimum_budget
from lever_actors.device.checksums import CHUNK_BYTES
from lever_actors.device.manifest import read_manifest
from lever_actors.engine import Engine
from lever_actors.model.sequential import sequential_reference
from lever_actors.model.transformer import Transformer
from tests.tiny_hf import save_tiny, tiny_model

PROMPT = [3, 14, 15, 92, 65]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def source(request, tmp_path_factory):
    hf = save_tiny(tiny_model(request.param, layers=4), tmp_path_factory.mktemp("hf") / "m")
    layout = tmp_path_factory.mktemp("flash") / "layout"
    convert(hf, layout, torch.float64)
    reference = load_hf(hf, torch.float64)
    expected = sequential_reference(
        Transformer(reference.args, reference.weights), PROMPT, NEW_TOKENS
    )
    return layout, expected


def budgets(layout: Path) -> dict[str, int]:
    manifest = read_manifest(layout)
    least = minimum_budget(manifest)
    return {
        "everything": manifest.file_bytes,
        "minimum": least,
        "mixed": least + manifest.layer(0).nbytes,
    }


def flash_ar(layout: Path, budget: int) -> EngineConfig:
    return EngineConfig(target=str(layout), dram_budget=budget, tree="none")


async def decode(engine: Engine, n: int = NEW_TOKENS) -> list[int]:
    return (await engine.generate(PROMPT, max_new_tokens=n)).tokens


@pytest.mark.parametrize("budget", ["everything", "minimum", "mixed"])
async def test_flash_decoding_equals_reference(source, budget):
    layout, expected = source
    async with Engine.open(flash_ar(layout, budgets(layout)[budget])) as engine:
        assert await decode(engine) == expected


async def test_bytes_read_per_token_are_one_pass_of_streamed_layers(source):
    layout, _ = source
    async with Engine.open(flash_ar(layout, budgets(layout)["mixed"])) as engine:
        target = engine.target
        await check_reads(engine, target)


async def check_reads(engine, target):
    manifest, plan = target.manifest, target.plan
    reads: Counter[int] = Counter()
    read_extent = target.store.read_extent

    def counting(extent, buffer, **options):
        reads[extent.key] += 1
        return read_extent(extent, buffer, **options)

    target.store.read_extent = counting
    loaded = target.store.stats.bytes_read
    assert loaded == sum(manifest.extent(k).nbytes for k in plan.resident)
    await decode(engine)
    assert plan.streamed_layers == (0, 2, 3) and "layer.1" in plan.resident
    streamed = [f"layer.{i}" for i in plan.streamed_layers]
    assert set(reads) == set(streamed)  # resident layers were read once, at load, never again
    for key in streamed:
        # one read per token, plus at most one read-ahead into the next pass
        assert NEW_TOKENS <= reads[key] <= NEW_TOKENS + 1
    read_ahead = sum(reads[k] - NEW_TOKENS for k in streamed)
    assert read_ahead <= plan.ring_slots
    layer_bytes = sum(reads[k] * manifest.extent(k).nbytes for k in streamed)
    rows = target.store.stats.bytes_read - loaded - layer_bytes
    # embedding rows on demand: each its checksum chunks, at most two, and a block of slack
    assert 0 < rows <= (len(PROMPT) + NEW_TOKENS) * (2 * CHUNK_BYTES + 4096)


async def test_each_step_reports_the_flash_reads_made_during_it(source):
    """What the cost model learns the bandwidth from: every decoding step streams its
    layers, and the steps' reads add up to the store's (the prefill's come before them)."""
    layout, _ = source
    async with Engine.open(flash_ar(layout, budgets(layout)["mixed"])) as engine:
        stats = engine.target.store.stats
        before = stats.bytes_read, stats.read_seconds
        result = await engine.generate(PROMPT, max_new_tokens=NEW_TOKENS)
        streamed = sum(engine.target.manifest.layer(i).nbytes for i in (1, 2, 3))
        for step in result.steps[1:]:
            assert step.bytes_read >= streamed - 2 * engine.target.plan.slot_bytes
            assert step.read_seconds > 0
        assert sum(s.bytes_read for s in result.steps) <= stats.bytes_read - before[0]
        assert sum(s.read_seconds for s in result.steps) <= stats.read_seconds - before[1]


async def test_everything_resident_reads_nothing_while_decoding(source):
    layout, _ = source
    async with Engine.open(flash_ar(layout, budgets(layout)["everything"])) as engine:
        loaded = engine.target.store.stats.bytes_read
        await decode(engine)
        assert engine.target.store.stats.bytes_read == loaded == read_manifest(layout).file_bytes


async def test_cancelling_a_request_leaves_the_engine_serving(source):
    layout, expected = source
    async with Engine.open(flash_ar(layout, budgets(layout)["minimum"])) as engine:
        with trio.move_on_after(0.05):
            await decode(engine, 200)
        assert await decode(engine) == expected
        assert engine.npu.running == engine.cpu.running == 0
