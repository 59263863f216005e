"""Readers for HF safetensors directories and GGUF files."""

from __future__ import annotations

from pathlib import Path

import torch

from lever_actors.checkpoints.checkpoint import Checkpoint
from lever_actors.checkpoints.flash_layout import load_flash_layout
from lever_actors.checkpoints.gguf_file import load_gguf
from lever_actors.checkpoints.hf import load_hf
from lever_actors.device.layout import MANIFEST_NAME
from lever_actors.errors import CheckpointError


def load_checkpoint(path: str | Path, dtype: torch.dtype) -> Checkpoint:
    """Load an HF directory, a .gguf file or a flash layout whole into DRAM, as `dtype`."""
    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        return load_flash_layout(path, dtype)
    if path.is_dir():
        return load_hf(path, dtype)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    raise CheckpointError(
        f"{path}: expected an HF checkpoint directory, a .gguf file or a flash layout"
    )
