"""A GGUF as it is: converted once into the cache's flash layouts, on its first use (the
real pair's target, and any the user names). A layout is named by the file and its
identity, so an edited or replaced file converts anew; one conversion of a file at a time."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.layout_cache import (
    GGUF_WEIGHTS,
    is_current,
    layout_path,
    weights_suffix,
)
from lever_actors.config import Weights
from lever_actors.paths import exclusive
from lever_actors.progress import Progress
from lever_actors.threads import on_a_thread_of_its_own


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
    suffix = weights_suffix(weights)
    layout = layout_path(gguf_path, cache_dir, weights, name)
    waiting = f"waiting for another process converting {gguf_path.name}"
    # one conversion at a time: a second would convert it all again, then fail to rename
    with exclusive(layout.parent, lambda: print(waiting, file=sys.stderr)):
        if layout.is_dir() and not is_current(layout):
            print(f"{layout.name} was written by another lever_actors version", file=sys.stderr)
            shutil.rmtree(layout)  # ours to replace: the cache is ours, the GGUF stays
        if not layout.is_dir():
            print(f"converting {gguf_path.name} to a {suffix} flash layout (once)", file=sys.stderr)
            # its torch team ends with its thread: the engine that follows keeps the only one
            on_a_thread_of_its_own(convert, gguf_path, layout, torch.bfloat16, progress, weights)
    return layout
