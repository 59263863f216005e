"""Where the cache keeps a GGUF's flash layout, and whether one there is current: without
torch, so that a process whose layout is ready need not load it (checkpoints/gguf_layout.py
converts one that is not)."""

from __future__ import annotations

from pathlib import Path

from lever_actors.config import Weights
from lever_actors.device.manifest import MANIFEST_VERSION, manifest_version
from lever_actors.paths import cache_key, file_identity

GGUF_MAGIC = b"GGUF"
# a layout's matrices where none is asked: as the GGUF keeps them
GGUF_WEIGHTS: Weights = "auto"
# the real target's layout when none is named: its matrices as the GGUF keeps them
REAL_TARGET_WEIGHTS: Weights = GGUF_WEIGHTS


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts as a GGUF does."""
    try:
        with path.open("rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:  # a directory (a layout), or nothing there
        return False


def layout_path(
    gguf_path: Path, cache_dir: Path, weights: Weights = GGUF_WEIGHTS, name: str | None = None
) -> Path:
    """Where `gguf_path`'s layout of `weights` lives under `cache_dir`: `name` (the real
    pair's, whose files are ours), else the file's own with its identity."""
    suffix = weights_suffix(weights)
    name = name or f"{gguf_path.stem}-{cache_key(file_identity(gguf_path))[:12]}"
    return cache_dir / "flash" / f"{name}-{suffix}"


def weights_suffix(weights: Weights) -> str:
    return {"dense": "bf16", "auto": "quantized"}.get(weights, weights)


def is_current(layout: Path) -> bool:
    """Whether a layout is there, written by this version of lever_actors."""
    return layout.is_dir() and manifest_version(layout) == MANIFEST_VERSION
