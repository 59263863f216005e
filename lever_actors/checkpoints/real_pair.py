"""The real model pair in the cache: GGUFs fetched and the target converted on first use;
`real_pair()`, the EngineConfig the CLI runs by default, in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lever_actors.checkpoints.fetch import REAL_MODELS, fetch_model
from lever_actors.checkpoints.gguf_layout import gguf_layout
from lever_actors.checkpoints.layout_cache import REAL_TARGET_WEIGHTS
from lever_actors.config import EngineConfig, Weights
from lever_actors.paths import default_cache_dir
from lever_actors.progress import Progress, ProgressLine


def real_model_path(cache_dir: Path, key: str, progress: Progress | None = None) -> Path:
    """The assembled GGUF of the real "draft" or "target", fetched if absent."""
    return fetch_model(REAL_MODELS[key], cache_dir, progress=progress)


def real_target_layout(
    cache_dir: Path, progress: Progress | None = None, weights: Weights = REAL_TARGET_WEIGHTS
) -> Path:
    """The real target's flash layout, converted from its GGUF once (gguf_layout.py)."""
    gguf_path = real_model_path(cache_dir, "target", progress)
    return gguf_layout(gguf_path, cache_dir, progress, weights, name=gguf_path.stem)


def real_pair(
    cache_dir: Path | None = None, weights: Weights = REAL_TARGET_WEIGHTS, **fields: Any
) -> EngineConfig:
    """Blocking: an EngineConfig of the real pair (Qwen2.5-Coder 1.5B Instruct Q4_K_M, its
    0.5B as the draft) with `fields` set; the GGUFs fetched and the target converted into
    `cache_dir` (default: ~/.cache/lever_actors) on first use, minutes once, with progress
    on stderr. `fields` are checked before anything is fetched."""
    EngineConfig(target="the real target", draft="the real draft", **fields)
    cache = cache_dir or default_cache_dir()
    target = real_target_layout(cache, ProgressLine(), weights)
    draft = real_model_path(cache, "draft", ProgressLine())
    return EngineConfig(target=str(target), draft=str(draft), **fields)
