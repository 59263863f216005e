"""The prefetcher actor: streams target layers from flash into a ring of DRAM slots, forever."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from functools import partial

import trio

from lever_actors.channels.messages import LayerWeights, SlotRelease
from lever_actors.device.budget import ResidencyPlan
from lever_actors.device.flash import FlashStore
from lever_actors.device.manifest import layer_key
from lever_actors.device.reads import AlignedBuffer
from lever_actors.model.weights import LayerTensors


@dataclass
class PrefetchStats:
    layers_sent: int = 0
    slot_wait_seconds: float = 0.0  # time spent with every slot full, waiting for a release
    max_slots_held: int = 0  # most slots filled and not yet released at any moment


class Prefetcher:
    """Walks the layers in order, pass after pass: resident layers are sent as they are, each
    run of them in one message; a streamed one is read into a free slot first. It waits only
    when every slot is in use, so reading the next layers (of this pass or the next) overlaps
    the verifier's compute. A streamed layer is checked against its checksums on a second
    thread while the next one is read, and sent only once checked."""

    def __init__(
        self, store: FlashStore, plan: ResidencyPlan, resident_layers: dict[int, LayerTensors]
    ) -> None:
        self.store = store
        self.plan = plan
        self.resident_layers = resident_layers
        self.stats = PrefetchStats()

    async def run(
        self,
        inbox: trio.MemoryReceiveChannel[SlotRelease],
        outbox: trio.MemorySendChannel[LayerWeights],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with inbox, outbox:
            slots = [AlignedBuffer(self.plan.slot_bytes) for _ in range(self.plan.ring_slots)]
            # unbuffered: the reader starts layer k+1 as the checker takes layer k
            read, unchecked = trio.open_memory_channel[LayerWeights](0)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read, inbox, read, slots)
                nursery.start_soon(self._check, unchecked, outbox, slots)
                task_status.started()

    async def _read(
        self,
        inbox: trio.MemoryReceiveChannel[SlotRelease],
        outbox: trio.MemorySendChannel[LayerWeights],
        slots: list[AlignedBuffer],
    ) -> None:
        manifest = self.store.manifest
        free = list(range(len(slots)))
        async with outbox:
            try:
                for pass_index in itertools.count():
                    # each run of resident layers whole, sent before the next streamed one
                    # waits for a slot (the verifier may need them first)
                    for resident, run in itertools.groupby(
                        range(manifest.args.n_layers), key=self.resident_layers.__contains__
                    ):
                        layers = list(run)
                        if resident:
                            tensors = [self.resident_layers[layer] for layer in layers]
                            await outbox.send(
                                LayerWeights(
                                    step=pass_index, first=layers[0], tensors=tensors, slot=None
                                )
                            )
                            continue
                        for layer in layers:
                            slot = await self._free_slot(free, inbox, len(slots))
                            extent = manifest.extent(layer_key(layer))
                            read = await trio.to_thread.run_sync(
                                partial(self.store.read_extent, check=False), extent, slots[slot]
                            )
                            await outbox.send(
                                LayerWeights(
                                    step=pass_index, first=layer, tensors=[read], slot=slot
                                )
                            )
            except (trio.BrokenResourceError, trio.EndOfChannel):
                return  # the consumer is gone: stop streaming

    async def _check(
        self,
        inbox: trio.MemoryReceiveChannel[LayerWeights],
        outbox: trio.MemorySendChannel[LayerWeights],
        slots: list[AlignedBuffer],
    ) -> None:
        async with inbox:
            async for layer in inbox:
                if layer.slot is not None and self.store.verify:
                    extent = self.store.manifest.extent(layer_key(layer.first))
                    await trio.to_thread.run_sync(
                        self.store.check_extent, extent, slots[layer.slot]
                    )
                try:
                    await outbox.send(layer)
                except trio.BrokenResourceError:
                    return  # the verifier is gone: stop streaming
                self.stats.layers_sent += len(layer.tensors)

    async def _free_slot(
        self, free: list[int], inbox: trio.MemoryReceiveChannel[SlotRelease], n_slots: int
    ) -> int:
        while True:
            try:
                free.append(inbox.receive_nowait().slot)
            except trio.WouldBlock:
                break
        if not free:
            started = time.perf_counter()
            free.append((await inbox.receive()).slot)
            self.stats.slot_wait_seconds += time.perf_counter() - started
        slot = free.pop(0)
        self.stats.max_slots_held = max(self.stats.max_slots_held, n_slots - len(free))
        return slot
