"""The DRAM budget for target weights: which extents stay resident, how big the ring is.

Policy: the LM head (or the tied embedding) and the final norm are needed every step, so
they are resident first; then as many leading layers as fit beside the ring of streaming
slots; then the embedding table if room is left, otherwise its rows are read on demand
(a few KiB per token). A budget too small for the head beside the ring streams the head
too (dense or int8 heads), once per target pass, through a buffer of about a slot holding
two parts: one is read while the other is multiplied.
"""

from __future__ import annotations

import sys

import msgspec

from lever_actors.device.manifest import (
    ROW_STREAMED_FORMATS,
    Manifest,
    layer_key,
    stream_buffer_bytes,
)
from lever_actors.errors import ConfigError
from lever_actors.model.shapes import HEAD_ROWS
from lever_actors.sizes import format_bytes


class ResidencyPlan(msgspec.Struct, frozen=True):
    budget: int
    resident: tuple[str, ...]  # extent keys held in DRAM for the whole run
    streamed_layers: tuple[int, ...]  # read from flash on every pass
    ring_slots: int
    slot_bytes: int
    embed_rows_on_demand: bool
    # 0: the LM head is resident; else it is read from flash this many rows at a time, once
    # per target pass, through a buffer of head_buffer_bytes
    head_rows_per_read: int = 0
    head_buffer_bytes: int = 0

    @property
    def head_streamed(self) -> bool:
        return self.head_rows_per_read > 0

    @property
    def streams(self) -> bool:
        """Whether weights are read from flash as the model decodes."""
        return bool(self.streamed_layers) or self.head_streamed

    def used(self, manifest: Manifest) -> int:
        resident = sum(manifest.extent(k).nbytes for k in self.resident)
        return resident + self.ring_slots * self.slot_bytes + self.head_buffer_bytes


def head_key(manifest: Manifest) -> str:
    """The extent holding the LM head: its own, or the embedding when tied."""
    return "embed" if manifest.args.tie_embeddings else "lm_head"


def head_stream(manifest: Manifest) -> tuple[int, int] | None:
    """(rows per read, buffer bytes) of the LM head streamed in reads of about half a layer
    slot, whole HEAD_ROWS blocks each; None where its format cannot be read by rows."""
    (entry,) = manifest.extent(head_key(manifest)).tensors
    if entry.format not in ROW_STREAMED_FORMATS:
        return None
    slot = _slot_bytes(manifest)
    block = HEAD_ROWS * (entry.nbytes // entry.shape[0])
    rows = min(max(1, slot // (2 * block)) * HEAD_ROWS, entry.shape[0])
    return rows, stream_buffer_bytes(entry, rows)


def minimum_budget(manifest: Manifest, ring_slots: int = 2) -> int:
    """The least the planner accepts: the final norm, the ring's slots, and the LM head or,
    where it can stream and that is smaller, its read buffer."""
    return min(
        head_resident_budget(manifest, ring_slots), _streamed_head_budget(manifest, ring_slots)
    )


def _streamed_head_budget(manifest: Manifest, ring_slots: int) -> int:
    """The least budget with the head streamed; a head that cannot stream: unbounded."""
    stream = head_stream(manifest)
    if stream is None:
        return sys.maxsize
    return stream[1] + manifest.extent("final_norm").nbytes + ring_slots * _slot_bytes(manifest)


def head_resident_budget(manifest: Manifest, ring_slots: int = 2) -> int:
    """The least budget that keeps the LM head in DRAM beside the ring (below it, the head
    streams where its format allows)."""
    head = manifest.extent(head_key(manifest)).nbytes
    return head + manifest.extent("final_norm").nbytes + ring_slots * _slot_bytes(manifest)


def _slot_bytes(manifest: Manifest) -> int:
    """A ring slot holds any one layer."""
    return max(manifest.layer(i).nbytes for i in range(manifest.args.n_layers))


def plan_residency(manifest: Manifest, budget: int, ring_slots: int = 2) -> ResidencyPlan:
    n_layers = manifest.args.n_layers
    if ring_slots < 2:
        raise ConfigError(
            f"ring_slots must be at least 2 (one read while one computes), got {ring_slots}"
        )
    layers = [manifest.layer(i).nbytes for i in range(n_layers)]
    slot = max(layers)
    norm = manifest.extent("final_norm").nbytes
    head = manifest.extent(head_key(manifest)).nbytes
    everything = head + norm + sum(layers)
    stream = head_stream(manifest)
    streamed_minimum = _streamed_head_budget(manifest, ring_slots)
    # the head streams only where the budget cannot hold it beside the ring
    keeps_head = min(everything, head_resident_budget(manifest, ring_slots))
    stream_head = stream is not None and streamed_minimum <= budget < keeps_head
    minimum = minimum_budget(manifest, ring_slots)
    # a model smaller than the ring it would need simply stays resident
    if budget < minimum and budget < everything:
        held = "LM head's read buffer" if streamed_minimum == minimum else "LM head"
        raise ConfigError(
            f"dram_budget {format_bytes(budget)} is below the minimum {format_bytes(minimum)} "
            f"({minimum} bytes): {held} + final norm + {ring_slots} layer slots"
        )
    resident = ["final_norm"] if stream_head else [head_key(manifest), "final_norm"]
    left = budget - sum(manifest.extent(k).nbytes for k in resident)
    rows_per_read, buffer = stream if stream_head and stream else (0, 0)
    left -= buffer
    if sum(layers) <= left:
        streamed, slots = [], 0  # everything fits: the memory-resident case
    else:
        left -= ring_slots * slot
        streamed = spread_streamed_layers(layers, left)
        slots = ring_slots
    left -= sum(size for i, size in enumerate(layers) if i not in streamed)
    resident += [layer_key(i) for i in range(n_layers) if i not in streamed]
    streamed_table = stream_head and head_key(manifest) == "embed"  # a tied head streams
    if "embed" not in resident and manifest.extent("embed").nbytes <= left and not streamed_table:
        resident.append("embed")
    return ResidencyPlan(
        budget=budget,
        resident=tuple(resident),
        streamed_layers=tuple(streamed),
        ring_slots=slots,
        slot_bytes=slot if slots else 0,
        embed_rows_on_demand="embed" not in resident,
        head_rows_per_read=rows_per_read,
        head_buffer_bytes=buffer,
    )


def spread_streamed_layers(layers: list[int], room: int) -> list[int]:
    """Which layers stream when `room` bytes hold the rest: as many as the first layers that
    fit leave, spread evenly through the pass (each ending an equal run of layers), so that
    each is read while the layers before it compute, rather than all waiting at the pass's
    end for the ring's slots; the last layers where spread ones would not fit (layers of
    unequal sizes)."""
    n_layers, fitting = len(layers), 0
    while fitting < n_layers and layers[fitting] <= room:
        room -= layers[fitting]
        fitting += 1
    count = n_layers - fitting
    spread = [round((i + 1) * n_layers / count) - 1 for i in range(count)]
    kept = sum(size for i, size in enumerate(layers) if i not in spread)
    tail = list(range(fitting, n_layers))
    return spread if kept <= sum(layers[:fitting]) else tail


def grown_residency(manifest: Manifest, plan: ResidencyPlan, extra: int) -> ResidencyPlan:
    """`plan` with the streamed layers that `extra` more bytes hold made resident, first
    ones first (a pass reads the rest as before). The head stays as it is, and so does the
    ring while a layer streams: it is counted as held, since a running crew holds its slots
    (with no layer streamed, the next crew takes none)."""
    streamed = list(plan.streamed_layers)
    grown: list[str] = []
    while streamed and manifest.layer(streamed[0]).nbytes <= extra:
        extra -= manifest.layer(streamed[0]).nbytes
        grown.append(layer_key(streamed.pop(0)))
    return msgspec.structs.replace(
        plan,
        budget=plan.budget + sum(manifest.extent(key).nbytes for key in grown),
        resident=(*plan.resident, *grown),
        streamed_layers=tuple(streamed),
        ring_slots=plan.ring_slots if streamed else 0,
        slot_bytes=plan.slot_bytes if streamed else 0,
    )
