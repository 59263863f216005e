"""The EngineConfig `generate` and `serve` run: the flags' fields, and the models they name,
the real pair fetched and a GGUF target converted on first use."""

from __future__ import annotations

import argparse

from lever_actors.checkpoints.gguf_layout import gguf_layout
from lever_actors.checkpoints.layout_cache import is_gguf
from lever_actors.checkpoints.real_pair import real_pair
from lever_actors.cli.engine_options import engine_flags
from lever_actors.config import EngineConfig
from lever_actors.progress import ProgressLine


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The config the flags ask for. Without --target, the real pair (fetched and converted
    on first use)."""
    flags = engine_flags(args)
    if args.target is None:
        return real_pair(args.cache_dir, args.target_weights, **flags)
    target = args.target
    if is_gguf(target):  # as it is: converted once into the cache
        target = gguf_layout(target, args.cache_dir, ProgressLine(), args.target_weights)
    draft = str(args.draft) if args.draft else None
    return EngineConfig(target=str(target), draft=draft, **flags)
