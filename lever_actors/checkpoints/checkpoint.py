"""A loaded checkpoint: model args, weights in DRAM, and the tokenizer when the source has one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.model.args import ModelArgs
from lever_actors.model.weights import ModelWeights


@dataclass
class Checkpoint:
    args: ModelArgs
    weights: ModelWeights
    tokenizer: Tokenizer | None
    source: Path
