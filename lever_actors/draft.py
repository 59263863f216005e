"""The draft model: held whole in DRAM."""

from __future__ import annotations

from dataclasses import dataclass

from lever_actors.checkpoints import load_checkpoint
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.config import Weights
from lever_actors.device.layout import DTYPE_NAMES
from lever_actors.model.quantized import COMPUTE_DTYPE
from lever_actors.model.transformer import Transformer


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


def load_draft(path: str, dtype: str, weights: Weights = "auto") -> DraftModel:
    """From an HF directory, a GGUF file or a flash layout; `weights` as in
    checkpoints/quantize.py, where a quantized draft computes in bfloat16 (in another dtype
    "auto" keeps the draft dense)."""
    torch_dtype = DTYPE_NAMES[dtype]
    if weights == "auto" and torch_dtype != COMPUTE_DTYPE:
        weights = "dense"
    draft = load_checkpoint(path, torch_dtype, weights)
    return DraftModel(Transformer(draft.args, draft.weights.for_drafting()), draft.tokenizer, path)
