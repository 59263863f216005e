"""Load a whole flash layout into DRAM as a Checkpoint (a draft model, or memory-resident runs)."""

from __future__ import annotations

from pathlib import Path

import torch

from lever_actors.checkpoints.checkpoint import Checkpoint
from lever_actors.checkpoints.tokenizer import layout_tokenizer
from lever_actors.device.flash import FlashStore
from lever_actors.device.manifest import layer_key
from lever_actors.model.weights import ModelWeights, dense


def load_flash_layout(directory: Path, dtype: torch.dtype) -> Checkpoint:
    store = FlashStore(directory)
    try:
        manifest = store.manifest
        loaded = store.load_extents(manifest.extents)
        extents = {e.key: tensors for e, tensors in zip(manifest.extents, loaded, strict=True)}
    finally:
        store.close()
    embed = extents["embed"]["embed"]
    weights = ModelWeights(
        embed=embed,
        final_norm=dense(extents["final_norm"]["final_norm"]),
        lm_head=embed if manifest.args.tie_embeddings else extents["lm_head"]["lm_head"],
        layers=[extents[layer_key(i)] for i in range(manifest.args.n_layers)],
    )
    return Checkpoint(
        args=manifest.args,
        weights=weights.to(dtype),
        tokenizer=layout_tokenizer(directory, manifest),
        source=directory,
    )
