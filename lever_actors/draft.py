"""The draft model: held whole in DRAM."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from lever_actors.checkpoints.checkpoint import Checkpoint
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.checkpoints.snapshot import load_via_snapshot, snapshot_key
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.config import Weights
from lever_actors.device.layout import DTYPE_NAMES
from lever_actors.device.memory import return_freed_heap
from lever_actors.model.quantized import COMPUTE_DTYPE
from lever_actors.model.spilled import spill_rows
from lever_actors.model.transformer import Transformer
from lever_actors.paths import default_cache_dir


@dataclass
class DraftModel:
    """The draft, held whole in DRAM; several engines may share one."""

    model: Transformer
    tokenizer: Tokenizer | None
    source: str

    @property
    def dram_bytes(self) -> int:
        """What the draft's weights hold in DRAM, as loaded (its kernels' formats, a shared
        table once): what a memory limit must leave room for beside the target."""
        return self.model.weights.nbytes


def load_draft(
    path: str, dtype: str, weights: Weights = "auto", vocabulary: int | None = None
) -> DraftModel:
    """From an HF directory, a GGUF file or a flash layout; `weights` as in
    checkpoints/quantize.py, where a quantized draft computes in bfloat16 (in another dtype
    "auto" keeps the draft dense). With `vocabulary` (EngineConfig.draft_vocabulary) it
    proposes from those first ids alone, and the rows of its one table above them wait in
    a file for lookups (model/spilled.py)."""
    torch_dtype = DTYPE_NAMES[dtype]
    if weights == "auto" and torch_dtype != COMPUTE_DTYPE:
        weights = "dense"
    draft = _load_checkpoint(Path(path), dtype, weights)
    held = draft.weights.for_drafting()
    spilled = spill_rows(held.embed, vocabulary) if held.embed is held.lm_head else None
    if spilled is not None:  # one table, rows past `vocabulary`: they go to the file
        held = replace(held, embed=spilled, lm_head=spilled.resident)
    model = Transformer(draft.args, held).proposing(vocabulary)
    tokenizer = draft.tokenizer
    if spilled is not None:
        del draft, held
        return_freed_heap()  # the whole table, its far rows now in the file
    return DraftModel(model, tokenizer, path)


def _load_checkpoint(path: Path, dtype: str, weights: Weights) -> Checkpoint:
    """A file (a GGUF) is converted to our formats on load: its snapshot keeps the result."""
    load = partial(load_checkpoint, path, DTYPE_NAMES[dtype], weights)
    if not path.is_file():
        return load()
    key = snapshot_key(path, dtype, weights)
    return load_via_snapshot(default_cache_dir() / "snapshots", key, load, path)
