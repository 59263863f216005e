"""The engine's flags, shared by `generate` and `serve`, and the EngineConfig they make; the
sampling flags, shared by `generate` and `bench`."""

from __future__ import annotations

import argparse
import typing
from pathlib import Path
from typing import Any

import msgspec

from lever_actors.checkpoints.layout_cache import REAL_TARGET_WEIGHTS
from lever_actors.config import (
    DEFAULT_PROMPT_CACHE,
    SPILLED_PROMPT_CACHE,
    WEIGHTS_CHOICES,
    Plan,
    choices_of,
    default_of,
)
from lever_actors.model.sampling import Sampling
from lever_actors.sizes import compact_bytes


def add_engine_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument(
        "--target",
        type=Path,
        help="the target: a GGUF file (converted into the cache on first use) or a flash "
        "layout (from `convert`)",
    )
    gen.add_argument(
        "--target-weights",
        choices=WEIGHTS_CHOICES,
        default=REAL_TARGET_WEIGHTS,
        help="without --target, or with a GGUF: the target's layout, its matrices dense "
        f"(bfloat16) or quantized (see `convert --weights`) (default: {REAL_TARGET_WEIGHTS})",
    )
    gen.add_argument("--draft", type=Path, help="draft model: HF dir, GGUF file or flash layout")
    gen.add_argument(
        "--tree",
        help="none, chain:K, static:W1,W2,..., gaincost[:CAP] or lookup[:CAP] (copies from "
        "the text, no draft); given, it is followed as given (default: the plan's)",
    )
    _option(gen, "early_exit", help="trained needs `train-exit` first")
    gen.add_argument("--exit-layer", type=int, help="default: 7/8 of the way through")
    _option(gen, "prune_threshold", type=float)
    _option(
        gen,
        "prune_when",
        help="compute_bound: only passes that compute, not flash, paces, where pruning can pay",
    )
    gen.add_argument(
        "--draft-ahead",
        action="store_true",
        help="draft the next tree while the target verifies this one, beside passes that "
        "flash paces (default: off)",
    )
    gen.add_argument(
        "--no-lookup",
        dest="lookup",
        action="store_false",
        help="grow gain-cost trees from the draft alone, without tokens copied from the text "
        "(default: copies where they pay)",
    )
    _option(gen, "draft_dtype")
    _option(gen, "draft_weights", help="auto keeps a GGUF draft's precision class")
    gen.add_argument(
        "--draft-vocabulary",
        type=_count_or_all,
        default=default_of("draft_vocabulary"),
        help="the draft proposes only token ids below N, its LM head multiplying those rows "
        f"alone; all: every id (default: {default_of('draft_vocabulary')})",
    )
    gen.add_argument(
        "--draft-window",
        type=_count_or_all,
        default=default_of("draft_window"),
        metavar="N",
        help="the draft prefills at most a prompt's last N new tokens; all: every one "
        f"(default: {default_of('draft_window')})",
    )
    _option(gen, "projection")
    _option(gen, "units", help="split: small work on a second unit beside the batched one")
    gen.add_argument(
        "--dram-budget",
        help="target weights held in DRAM: auto (what the memory limit leaves beside the "
        "process, the draft and room for a context), 25%%, 1.5GiB or all (default: "
        f"{default_of('dram_budget')})",
    )
    gen.add_argument(
        "--plan",
        choices=typing.get_args(Plan),
        help="how tokens are proposed: trees (the draft's gain-cost trees), lookup (copies "
        "from the text, no draft in memory), ar (one token a pass), or auto, the one the "
        "cost model predicts fastest for the memory limit (default: auto, unless --tree "
        "is given)",
    )
    gen.add_argument(
        "--ctx-size",
        type=int,
        metavar="TOKENS",
        help="tokens a request's prompt and new ones may fill (default: the model's context, "
        "or less where the memory left after loading holds less KV)",
    )
    gen.add_argument(
        "--parallel",
        type=int,
        metavar="N",
        help="requests decoding at once, verified in one pass over the layers; more wait "
        "in arrival order (default: as many as the KV room after loading holds, at most 8)",
    )
    gen.add_argument(
        "--prompt-cache",
        metavar="SIZE",
        default=compact_bytes(DEFAULT_PROMPT_CACHE),
        help="finished requests' KV kept for later ones that start with the same tokens, "
        f"a size or 0 for none (default: {compact_bytes(DEFAULT_PROMPT_CACHE)})",
    )
    gen.add_argument(
        "--prompt-cache-dir",
        metavar="DIR",
        help="keep the prefixes the prompt cache lets go of, and all it holds at exit, in "
        f"DIR (at most {compact_bytes(SPILLED_PROMPT_CACHE)}), for later requests and runs",
    )
    gen.add_argument(
        "--stall-seconds",
        type=float,
        default=default_of("stall_seconds"),
        metavar="S",
        help="a request whose reader takes no token for S seconds is ended, so that it cannot "
        f"hold the engine (default: {default_of('stall_seconds')})",
    )
    _option(gen, "throttle", help="emulated phone flash")
    gen.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip the checksums of flash reads (default: every read is checked before use)",
    )
    gen.add_argument("--trace", type=Path, help="write every message between actors to FILE")


def engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the flags ask for, but the models (cli/engine_config.py)."""
    flags: dict[str, Any] = dict(
        throttle=args.throttle,
        verify_checksums=args.verify,
        early_exit=args.early_exit,
        exit_layer=args.exit_layer,
        prune_threshold=args.prune_threshold,
        prune_when=args.prune_when,
        draft_ahead=args.draft_ahead,
        lookup=args.lookup,
        draft_dtype=args.draft_dtype,
        draft_weights=args.draft_weights,
        draft_vocabulary=args.draft_vocabulary,
        draft_window=args.draft_window,
        projection=args.projection,
        units=args.units,
        prompt_cache=args.prompt_cache,
        prompt_cache_dir=args.prompt_cache_dir,
        ctx_size=args.ctx_size,
        parallel=args.parallel,
        stall_seconds=args.stall_seconds,
        trace=str(args.trace) if args.trace else None,
    )
    # left out, these take EngineConfig's defaults (the tree: one with a draft, else none)
    given = {"tree": args.tree, "dram_budget": args.dram_budget}
    flags |= {name: value for name, value in given.items() if value is not None}
    # a tree given is followed as given, unless a plan is asked for too
    flags["plan"] = args.plan or (None if args.tree else "auto")
    return flags


def _count_or_all(text: str) -> int | None:
    """--draft-vocabulary, --draft-window: a count of tokens, or all (None)."""
    if text == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of tokens or all, got {text!r}"
        ) from None


def _option(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """A flag for an EngineConfig field, with the library's default and, for a Literal field,
    its choices: both defined once, in config.py."""
    note, default = kwargs.pop("help", ""), default_of(name)
    parser.add_argument(
        "--" + name.replace("_", "-"),
        default=default,
        choices=choices_of(name),
        help=f"{note} (default: {default})".strip(),
        **kwargs,
    )


def add_sampling_arguments(group: argparse._ArgumentGroup) -> None:
    """--temperature, --top-k, --top-p, --min-p: Sampling's fields, with its defaults."""
    for field in msgspec.structs.fields(Sampling):
        if field.name != "seed":
            group.add_argument(
                "--" + field.name.replace("_", "-"),
                type=field.type,
                default=field.default,
                help=f"(default: {field.default})",
            )


def sampling_of(args: argparse.Namespace, seed: int) -> Sampling:
    """The Sampling the flags of `add_sampling_arguments` ask for, with `seed`."""
    fields = {f.name: getattr(args, f.name) for f in msgspec.structs.fields(Sampling)}
    return Sampling(**(fields | {"seed": seed}))


def split(text: str) -> tuple[str, ...]:
    """A comma-separated flag's parts."""
    return tuple(part.strip() for part in text.split(",") if part.strip())
