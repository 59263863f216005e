"""The draft model: held whole in DRAM, checked against the target's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

from lever_actors.checkpoints import load_checkpoint
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.config import EngineConfig
from lever_actors.device.layout import DTYPE_NAMES
from lever_actors.errors import ConfigError
from lever_actors.model.transformer import Transformer
from lever_actors.target import FlashTarget


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


def load_draft_for(config: EngineConfig) -> DraftModel | None:
    if config.tree_spec().kind == "none" or config.draft is None:
        return None
    return load_draft(config.draft, config.draft_dtype)


def check_same_vocabulary(target: FlashTarget, draft: DraftModel | None) -> None:
    if draft is None:
        return
    if draft.model.args.vocab_size != target.args.vocab_size:
        raise ConfigError(
            f"draft {draft.source} has a vocabulary of {draft.model.args.vocab_size} tokens, "
            f"the target {target.args.vocab_size}: speculative decoding needs the same vocabulary"
        )
    ours, theirs = target.tokenizer, draft.tokenizer
    if ours and theirs and ours.backend.get_vocab() != theirs.backend.get_vocab():
        raise ConfigError(f"draft {draft.source} and the target use different tokenizers")
