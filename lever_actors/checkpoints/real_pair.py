"""The real model pair in the cache: GGUFs fetched and the target converted on first use."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.fetch import REAL_MODELS, fetch_model
from lever_actors.device.layout import MANIFEST_VERSION, manifest_version
from lever_actors.progress import Progress


def real_model_path(cache_dir: Path, key: str, progress: Progress | None = None) -> Path:
    """The assembled GGUF of the real "draft" or "target", fetched if absent."""
    return fetch_model(REAL_MODELS[key], cache_dir, progress=progress)


def real_target_layout(cache_dir: Path, progress: Progress | None = None) -> Path:
    """The real target's bf16 flash layout, converted from its GGUF once."""
    gguf_path = real_model_path(cache_dir, "target", progress)
    layout = cache_dir / "flash" / (gguf_path.stem + "-bf16")
    if layout.is_dir() and manifest_version(layout) != MANIFEST_VERSION:
        print(f"{layout.name} was written by another lever_actors version", file=sys.stderr)
        shutil.rmtree(layout)  # ours to replace: the cache is ours, the GGUF stays
    if not layout.is_dir():
        print(f"converting {gguf_path.name} to a bf16 flash layout (once)", file=sys.stderr)
        convert(gguf_path, layout, torch.bfloat16, progress)
    return layout
