"""The prefetcher alone: a layout in, layers out, never more slots than the ring holds."""

from __future__ import annotations

import itertools

import pytest
import torch
import trio

from lever_actors.actors.prefetcher import Prefetcher
from lever_actors.channels.messages import LayerWeights, SlotRelease
from lever_actors.checkpoints.convert import convert
from lever_actors.device.budget import minimum_budget, plan_residency
from lever_actors.device.manifest import read_manifest
from lever_actors.target import FlashTarget
from tests.tiny_hf import save_tiny, tiny_model


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    hf = save_tiny(tiny_model("llama", layers=6), tmp_path_factory.mktemp("hf") / "m")
    out = tmp_path_factory.mktemp("flash") / "layout"
    convert(hf, out, torch.float64)
    return out


@pytest.mark.parametrize("ring_slots", [2, 3])
async def test_slow_consumer_never_sees_more_slots_than_the_ring(layout, ring_slots):
    manifest = read_manifest(layout)
    budget = minimum_budget(manifest, ring_slots) + manifest.layer(0).nbytes
    target = FlashTarget(layout, plan_residency(manifest, budget, ring_slots))
    prefetcher = Prefetcher(target.store, target.plan, target.resident_layers)
    layers_send, layers_recv = trio.open_memory_channel[LayerWeights](ring_slots)
    release_send, release_recv = trio.open_memory_channel[SlotRelease](ring_slots)
    received: list[tuple[int, int, int | None]] = []
    held: set[int] = set()
    most_held = 0
    async with trio.open_nursery() as nursery:
        await nursery.start(prefetcher.run, release_recv, layers_send)
        async with layers_recv, release_send:
            while len(received) < 3 * manifest.args.n_layers:
                message = await layers_recv.receive()
                assert message.slot is None or len(message.tensors) == 1  # a slot holds one
                received += [(message.step, layer, message.slot) for layer in message.layers]
                if message.slot is not None:
                    assert message.slot not in held  # a slot is never handed out twice
                    held.add(message.slot)
                    most_held = max(most_held, len(held))
                    await trio.sleep(0.01)  # slow consumer: the prefetcher must wait for slots
                    held.discard(message.slot)
                    await release_send.send(SlotRelease(step=message.step, slot=message.slot))
        # leaving the block closed our channel ends; the nursery only exits if the actor stopped
    expected = [(p, layer) for p in range(3) for layer in range(manifest.args.n_layers)]
    assert [(p, layer) for p, layer, _ in received] == expected
    streamed = target.plan.streamed_layers  # all but one, spread through the pass
    assert len(streamed) == manifest.args.n_layers - 1
    assert all((slot is None) == (layer not in streamed) for _, layer, slot in received)
    assert most_held <= ring_slots
    assert prefetcher.stats.max_slots_held <= ring_slots
    assert prefetcher.stats.slot_wait_seconds > 0


async def test_closing_the_consumer_end_stops_the_prefetcher(layout):
    manifest = read_manifest(layout)
    target = FlashTarget(layout, plan_residency(manifest, minimum_budget(manifest)))
    prefetcher = Prefetcher(target.store, target.plan, target.resident_layers)
    layers_send, layers_recv = trio.open_memory_channel[LayerWeights](2)
    release_send, release_recv = trio.open_memory_channel[SlotRelease](2)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(prefetcher.run, release_recv, layers_send)
            await layers_recv.receive()
            await layers_recv.aclose()
            await release_send.aclose()
    assert prefetcher.stats.layers_sent >= 1


async def test_resident_layers_go_a_run_a_message_and_a_streamed_one_alone(layout):
    manifest = read_manifest(layout)
    n_layers = manifest.args.n_layers
    budget = minimum_budget(manifest, 2) + 3 * manifest.layer(0).nbytes  # three layers resident
    target = FlashTarget(layout, plan_residency(manifest, budget, 2))
    prefetcher = Prefetcher(target.store, target.plan, target.resident_layers)
    layers_send, layers_recv = trio.open_memory_channel[LayerWeights](n_layers)
    release_send, release_recv = trio.open_memory_channel[SlotRelease](2)
    messages: list[LayerWeights] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(prefetcher.run, release_recv, layers_send)
        async with layers_recv, release_send:
            while sum(len(m.tensors) for m in messages) < n_layers:
                messages.append(await layers_recv.receive())
                if messages[-1].slot is not None:
                    await release_send.send(SlotRelease(step=0, slot=messages[-1].slot))
    assert [layer for m in messages for layer in m.layers] == list(range(n_layers))
    streamed = set(target.plan.streamed_layers)
    assert len(streamed) == n_layers - 3
    for m in messages:
        assert (m.slot is None) == (m.first not in streamed)
        assert len(m.tensors) == 1 or m.slot is None
    # each run of resident layers whole: none follows another without a streamed one between
    assert all(a.slot is not None or b.slot is not None for a, b in itertools.pairwise(messages))
