"""The DRAM budget for target weights: which extents stay resident, how big the ring is.

Policy: the LM head (or the tied embedding) and the final norm are needed every step, so
they are resident first; then as many leading layers as fit beside the ring of streaming
slots; then the embedding table if room is left, otherwise its rows are read on demand
(a few KiB per token).
"""

from __future__ import annotations

import msgspec

from lever_actors.device.layout import Manifest, layer_key
from lever_actors.errors import ConfigError
from lever_actors.sizes import format_bytes


class ResidencyPlan(msgspec.Struct, frozen=True):
    budget: int
    resident: tuple[str, ...]  # extent keys held in DRAM for the whole run
    streamed_layers: tuple[int, ...]  # read from flash on every pass
    ring_slots: int
    slot_bytes: int
    embed_rows_on_demand: bool

    def used(self, manifest: Manifest) -> int:
        resident = sum(manifest.extent(k).nbytes for k in self.resident)
        return resident + self.ring_slots * self.slot_bytes


def head_key(manifest: Manifest) -> str:
    """The extent holding the LM head: its own, or the embedding when tied."""
    return "embed" if manifest.args.tie_embeddings else "lm_head"


def minimum_budget(manifest: Manifest, ring_slots: int = 2) -> int:
    slot = max(manifest.layer(i).nbytes for i in range(manifest.args.n_layers))
    head = manifest.extent(head_key(manifest)).nbytes
    return head + manifest.extent("final_norm").nbytes + ring_slots * slot


def plan_residency(manifest: Manifest, budget: int, ring_slots: int = 2) -> ResidencyPlan:
    n_layers = manifest.args.n_layers
    if ring_slots < 2:
        raise ConfigError(
            f"ring_slots must be at least 2 (one read while one computes), got {ring_slots}"
        )
    resident = [head_key(manifest), "final_norm"]
    left = budget - sum(manifest.extent(k).nbytes for k in resident)
    layers = [manifest.layer(i).nbytes for i in range(n_layers)]
    minimum = minimum_budget(manifest, ring_slots)
    # a model smaller than the ring it would need simply stays resident
    if budget < minimum and sum(layers) > left:
        raise ConfigError(
            f"dram_budget {format_bytes(budget)} is below the minimum {format_bytes(minimum)} "
            f"({minimum} bytes): LM head + final norm + {ring_slots} layer slots"
        )
    if sum(layers) <= left:
        resident_layers, slots = n_layers, 0  # everything fits: the memory-resident case
    else:
        slot = max(layers)
        left -= ring_slots * slot
        resident_layers = 0
        while resident_layers < n_layers and layers[resident_layers] <= left:
            left -= layers[resident_layers]
            resident_layers += 1
        slots = ring_slots
    resident += [layer_key(i) for i in range(resident_layers)]
    if "embed" not in resident and manifest.extent("embed").nbytes <= left:
        resident.append("embed")
    return ResidencyPlan(
        budget=budget,
        resident=tuple(resident),
        streamed_layers=tuple(range(resident_layers, n_layers)),
        ring_slots=slots,
        slot_bytes=max(layers) if slots else 0,
        embed_rows_on_demand="embed" not in resident,
    )
