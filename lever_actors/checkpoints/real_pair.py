"""The real model pair in the cache: GGUFs fetched and the target converted on first use."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.fetch import REAL_MODELS, fetch_model
from lever_actors.config import Weights
from lever_actors.device.layout import MANIFEST_VERSION, manifest_version
from lever_actors.paths import exclusive
from lever_actors.progress import Progress


def real_model_path(cache_dir: Path, key: str, progress: Progress | None = None) -> Path:
    """The assembled GGUF of the real "draft" or "target", fetched if absent."""
    return fetch_model(REAL_MODELS[key], cache_dir, progress=progress)


# the real target's layout when none is named: its matrices as the GGUF keeps them
REAL_TARGET_WEIGHTS: Weights = "auto"


def real_target_layout(
    cache_dir: Path, progress: Progress | None = None, weights: Weights = REAL_TARGET_WEIGHTS
) -> Path:
    """The real target's flash layout, converted from its GGUF once: bf16 ("dense"), or
    with its matrices in the file's own 4- and 8-bit classes ("auto"), or q4, q8."""
    gguf_path = real_model_path(cache_dir, "target", progress)
    suffix = {"dense": "bf16", "auto": "quantized"}.get(weights, weights)
    layout = cache_dir / "flash" / f"{gguf_path.stem}-{suffix}"
    waiting = f"waiting for another process converting {gguf_path.name}"
    # one conversion at a time: a second would convert it all again, then fail to rename
    with exclusive(layout.parent, lambda: print(waiting, file=sys.stderr)):
        if layout.is_dir() and manifest_version(layout) != MANIFEST_VERSION:
            print(f"{layout.name} was written by another lever_actors version", file=sys.stderr)
            shutil.rmtree(layout)  # ours to replace: the cache is ours, the GGUF stays
        if not layout.is_dir():
            print(f"converting {gguf_path.name} to a {suffix} flash layout (once)", file=sys.stderr)
            convert(gguf_path, layout, torch.bfloat16, progress, weights)
    return layout
