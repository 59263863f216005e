"""Loading an HF directory, a GGUF file or a flash layout whole into DRAM, and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from lever_actors.checkpoints.checkpoint import Checkpoint
from lever_actors.checkpoints.flash_layout import load_flash_layout
from lever_actors.checkpoints.gguf_file import load_gguf
from lever_actors.checkpoints.hf import load_hf
from lever_actors.checkpoints.quantize import check_choice, quantize_checkpoint
from lever_actors.checkpoints.tokenizer import Tokenizer, layout_tokenizer
from lever_actors.config import Weights
from lever_actors.device.manifest import MANIFEST_NAME, read_manifest
from lever_actors.device.memory import return_freed_heap
from lever_actors.errors import CheckpointError


def load_checkpoint(path: str | Path, dtype: torch.dtype, weights: Weights = "dense") -> Checkpoint:
    """Load an HF directory, a .gguf file or a flash layout whole into DRAM, as `dtype`, its
    matrices quantized as `weights` says (checkpoints/quantize.py; a flash layout keeps the
    formats it was converted to)."""
    checkpoint = _read(Path(path), dtype, check_choice(weights, dtype))
    return_freed_heap()  # the readers' temporaries: hundreds of MB a memory limit would count
    return checkpoint


def _read(path: Path, dtype: torch.dtype, weights: Weights) -> Checkpoint:
    if (path / MANIFEST_NAME).is_file():
        return load_flash_layout(path, dtype)
    if path.is_dir():
        if weights in ("dense", "auto"):  # an HF checkpoint holds no precision class to keep
            return load_hf(path, dtype)
        return quantize_checkpoint(load_hf(path, torch.float32), weights)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype, weights)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    raise CheckpointError(
        f"{path}: expected an HF checkpoint directory, a .gguf file or a flash layout"
    )


def load_tokenizer(path: Path) -> Tokenizer | None:
    """The tokenizer of a flash layout, an HF directory or a GGUF file, if it has one."""
    if (path / MANIFEST_NAME).is_file():
        return layout_tokenizer(path, read_manifest(path))
    if path.is_dir():
        tokenizer = path / "tokenizer.json"
        return Tokenizer.from_file(tokenizer) if tokenizer.is_file() else None
    return load_checkpoint(path, torch.float32).tokenizer
