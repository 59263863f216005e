"""The draft model: held whole in DRAM."""

from __future__ import annotations

from dataclasses import dataclass

from lever_actors.checkpoints import load_checkpoint
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.device.layout import DTYPE_NAMES
from lever_actors.model.transformer import Transformer


@dataclass
class DraftModel:
    """The draft, held whole in DRAM; several engines may share one."""

    model: Transformer
    tokenizer: Tokenizer | None
    source: str


def load_draft(path: str, dtype: str) -> DraftModel:
    """From an HF directory, a GGUF file or a flash layout."""
    draft = load_checkpoint(path, DTYPE_NAMES[dtype])
    return DraftModel(Transformer(draft.args, draft.weights), draft.tokenizer, path)
