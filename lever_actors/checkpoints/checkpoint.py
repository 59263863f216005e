"""A loaded checkpoint: model args, weights in DRAM, and the tokenizer when the source has one."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.errors import CheckpointError
from lever_actors.model.args import ModelArgs
from lever_actors.model.weights import ModelWeights


@dataclass
class Checkpoint:
    args: ModelArgs
    weights: ModelWeights
    tokenizer: Tokenizer | None
    source: Path


def check_layer_count(
    names: Iterable[object], prefix: tuple[str, ...], n_layers: int, field: str
) -> None:
    """No tensor name `prefix + (i, ...)` (split at dots) may have a layer i past the
    `n_layers` the metadata's `field` ("FILE: KEY") declares: a file with more layers than
    its metadata says is corrupt, not a smaller model."""
    depth = len(prefix)
    layers = [
        int(parts[depth])
        for name in names
        if len(parts := str(name).split(".")) > depth + 1
        and tuple(parts[:depth]) == prefix
        and parts[depth].isdecimal()
    ]
    last = max(layers, default=-1)
    if last >= n_layers:
        raise CheckpointError(f"{field} = {n_layers}, but the file holds tensors of layer {last}")
