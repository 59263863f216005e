"""The flash-resident target: a flash layout opened under a DRAM budget."""

from __future__ import annotations

from pathlib import Path

import torch

from lever_actors.checkpoints.tokenizer import layout_tokenizer
from lever_actors.device.budget import ResidencyPlan, head_key
from lever_actors.device.flash import FlashStore
from lever_actors.device.layout import torch_dtype
from lever_actors.device.manifest import layer_key
from lever_actors.device.reads import AlignedBuffer
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.layers import (
    capped_logits,
    embedding,
    head_products,
    output_logits,
    rms_norm,
)
from lever_actors.model.rope import Rope
from lever_actors.model.weights import Weight, dense

Resident = dict[str, dict[str, Weight]]  # the plan's resident extents, as read: key -> tensors


def read_resident(store: FlashStore, plan: ResidencyPlan) -> Resident:
    """Blocking: the extents `plan` holds in DRAM, each read (and checked) into its own
    buffer. No torch computation: it may run on any thread, beside another load."""
    extents = [store.manifest.extent(key) for key in plan.resident]
    return dict(zip(plan.resident, store.load_extents(extents), strict=True))


class FlashTarget:
    """Holds the resident extents the plan chose, reads the rest through a Prefetcher."""

    def __init__(
        self,
        directory: Path,
        plan: ResidencyPlan,
        *,
        throttle: str = "none",
        verify: bool = True,
        resident: Resident | None = None,
    ) -> None:
        """`plan`: the `residency` of this layout's manifest, made once by the caller;
        `resident`: its extents already read by `read_resident` (else they are read now)."""
        self.store = FlashStore(directory, throttle=throttle, verify=verify)
        self.manifest = self.store.manifest
        self.args = self.manifest.args
        self.dtype = torch_dtype(self.manifest)
        self.plan = plan
        if resident is None:
            resident = read_resident(self.store, plan)
        head = head_key(self.manifest)
        # None where the budget streams the head (`logits` then reads it each pass)
        self.lm_head: Weight | None = resident[head][head] if head in resident else None
        self._head_buffer = AlignedBuffer(self.plan.head_buffer_bytes)
        self.final_norm = dense(resident["final_norm"]["final_norm"])
        self.embed_table = resident["embed"]["embed"] if "embed" in resident else None
        self.resident_layers = {
            i: resident[layer_key(i)] for i in range(self.args.n_layers) if layer_key(i) in resident
        }
        self.rope = Rope(self.args)
        self.tokenizer = layout_tokenizer(directory, self.manifest)

    def hold(self, plan: ResidencyPlan) -> None:
        """Blocking: the layers `plan` holds that this target streams, read (and checked)
        into DRAM, then resident from the next pass on; the ring stays as it is."""
        held = [i for i in self.plan.streamed_layers if i not in plan.streamed_layers]
        loaded = self.store.load_extents([self.manifest.layer(i) for i in held])
        self.resident_layers.update(zip(held, loaded, strict=True))
        self.plan = plan

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.args, capacity, self.dtype)

    def embed(self, tokens: list[int]) -> torch.Tensor:
        """-> [n, d_model]; rows come from flash when the table is not resident."""
        if self.embed_table is not None:
            rows = self.embed_table[torch.tensor(tokens)]
        else:
            rows = self.store.read_rows(self.manifest.extent("embed"), tokens)
        return embedding(rows, self.args)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Blocking; one caller at a time. hidden: [n, d_model] -> [n, vocab]; a streamed
        head is read from flash once for all n rows, block by block as a resident one."""
        if self.lm_head is not None:
            return output_logits(hidden, self.final_norm, self.lm_head, self.args)
        normed = rms_norm(hidden, self.final_norm, self.args.norm_eps)
        extent = self.manifest.extent(head_key(self.manifest))
        parts = self.store.stream_rows(extent, self.plan.head_rows_per_read, self._head_buffer)
        logits = normed.new_empty(len(normed), self.args.vocab_size)
        done = 0
        for rows in parts:
            head_products(normed, rows, logits[:, done : done + rows.shape[0]])
            done += rows.shape[0]
        return capped_logits(logits, self.args)

    def close(self) -> None:
        """Close the layout and let go of the weights read from it, so that a closed target
        still referenced (by a closed engine, say) holds no DRAM. Closing twice is harmless."""
        self.store.close()
        self.lm_head = self.embed_table = None
        self.resident_layers = {}
        self._head_buffer = AlignedBuffer(0)
