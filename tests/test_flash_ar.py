"""Flash-offloaded greedy decoding equals the reference, under every kind of DRAM budget."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import trio

from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.hf import load_hf
from lever_actors.device.budget import minimum_budget
from lever_actors.device.layout import read_manifest
from lever_actors.flash_ar import flash_greedy
from lever_actors.model.greedy import greedy_reference
from lever_actors.model.transformer import Transformer
from lever_actors.target import FlashTarget
from tests.tiny_hf import save_tiny, tiny_model

PROMPT = [3, 14, 15, 92, 65]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def source(request, tmp_path_factory):
    hf = save_tiny(tiny_model(request.param, layers=4), tmp_path_factory.mktemp("hf") / "m")
    layout = tmp_path_factory.mktemp("flash") / "layout"
    convert(hf, layout, torch.float64)
    reference = load_hf(hf, torch.float64)
    expected = greedy_reference(Transformer(reference.args, reference.weights), PROMPT, NEW_TOKENS)
    return layout, expected


def budgets(layout: Path) -> dict[str, int]:
    manifest = read_manifest(layout)
    least = minimum_budget(manifest)
    return {
        "everything": manifest.file_bytes,
        "minimum": least,
        "mixed": least + manifest.layer(0).nbytes,
    }


async def decode(target: FlashTarget) -> list[int]:
    tokens: list[int] = []
    await flash_greedy(target, PROMPT, NEW_TOKENS, tokens.append)
    return tokens


@pytest.mark.parametrize("budget", ["everything", "minimum", "mixed"])
async def test_flash_decoding_equals_reference(source, budget):
    layout, expected = source
    target = FlashTarget(layout, budgets(layout)[budget])
    assert await decode(target) == expected


async def test_bytes_read_per_token_are_one_pass_of_streamed_layers(source):
    layout, _ = source
    target = FlashTarget(layout, budgets(layout)["mixed"])
    manifest, plan = target.manifest, target.plan
    reads: Counter[int] = Counter()
    read_extent = target.store.read_extent

    def counting(extent, buffer):
        reads[extent.key] += 1
        return read_extent(extent, buffer)

    target.store.read_extent = counting
    loaded = target.store.stats.bytes_read
    assert loaded == sum(manifest.extent(k).nbytes for k in plan.resident)
    await decode(target)
    assert plan.streamed_layers == (1, 2, 3) and "layer.0" in plan.resident
    streamed = [f"layer.{i}" for i in plan.streamed_layers]
    assert set(reads) == set(streamed)  # resident layers were read once, at load, never again
    for key in streamed:
        # one read per token, plus at most one read-ahead into the next pass
        assert NEW_TOKENS <= reads[key] <= NEW_TOKENS + 1
    read_ahead = sum(reads[k] - NEW_TOKENS for k in streamed)
    assert read_ahead <= plan.ring_slots
    layer_bytes = sum(reads[k] * manifest.extent(k).nbytes for k in streamed)
    rows = target.store.stats.bytes_read - loaded - layer_bytes
    assert 0 < rows <= (len(PROMPT) + NEW_TOKENS) * 2 * 4096  # embedding rows on demand


async def test_everything_resident_reads_nothing_while_decoding(source):
    layout, _ = source
    target = FlashTarget(layout, budgets(layout)["everything"])
    loaded = target.store.stats.bytes_read
    await decode(target)
    assert target.store.stats.bytes_read == loaded == read_manifest(layout).file_bytes


async def test_stop_token(source):
    layout, expected = source
    target = FlashTarget(layout, budgets(layout)["minimum"])
    tokens: list[int] = []
    await flash_greedy(target, PROMPT, NEW_TOKENS, tokens.append, frozenset({expected[3]}))
    assert tokens == expected[: expected.index(expected[3]) + 1]


async def test_cancelling_stops_prefetcher_and_threads(source):
    layout, _ = source
    target = FlashTarget(layout, budgets(layout)["minimum"])
    with trio.move_on_after(0.05):
        await flash_greedy(target, PROMPT, 10_000, lambda _: None)
    # a fresh request still decodes correctly on the same target
    assert len(await decode(target)) == NEW_TOKENS
