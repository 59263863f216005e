"""A GGUF as it is: converted once into the cache's flash layouts, on its first use (the
real pair's target, and any the user names). A layout is named by the file and its
identity, so an edited or replaced file converts anew; one conversion of a file at a time."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from lever_actors.checkpoints.convert import convert
from lever_actors.config import Weights
from lever_actors.device.manifest import MANIFEST_VERSION, manifest_version
from lever_actors.paths import cache_key, exclusive, file_identity
from lever_actors.progress import Progress

GGUF_MAGIC = b"GGUF"
# a layout's matrices where none is asked: as the GGUF keeps them
GGUF_WEIGHTS: Weights = "auto"


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts as a GGUF does."""
    try:
        with path.open("rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:  # a directory (a layout), or nothing there
        return False


def gguf_layout(
    gguf_path: Path,
    cache_dir: Path,
    progress: Progress | None = None,
    weights: Weights = GGUF_WEIGHTS,
    name: str | None = None,
) -> Path:
    """The flash layout of `gguf_path` under `cache_dir`, converted once: bf16 ("dense"),
    or its matrices in the file's own 4- and 8-bit classes ("auto"), or q4, q8. `name`:
    the layout's, where the file is ours (the real pair's); else the file's with its
    identity."""
    suffix = {"dense": "bf16", "auto": "quantized"}.get(weights, weights)
    name = name or f"{gguf_path.stem}-{cache_key(file_identity(gguf_path))[:12]}"
    layout = cache_dir / "flash" / f"{name}-{suffix}"
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
