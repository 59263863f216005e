"""`lever-actors bench`: decoding modes side by side on real prompts, results to JSON."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import msgspec
import trio

from lever_actors.bench.prompts import PROMPT_SETS

MODES = (
    "memory-ar",
    "flash-ar",
    "sd-chain",
    "sd-static",
    "lever",
    "lever-no-gaincost",
    "lever-no-prune",
    "lever-eager",
    "lever-single-unit",
    "peer-memory",
)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--modes",
        default="memory-ar,flash-ar",
        help=f"comma-separated, the first is the agreement reference; known: {', '.join(MODES)}",
    )
    parser.add_argument(
        "--target",
        type=Path,
        default=None,
        help="the target: a flash layout (needed by flash modes), or a GGUF file / HF directory "
        "for memory modes (default: the real 1.5B target as a bf16 layout, made once)",
    )
    parser.add_argument(
        "--budgets",
        default="25%,50%,100%",
        help="DRAM budgets for flash modes: percentages of the target's weights or sizes (1.5GiB)",
    )
    parser.add_argument("--throttle", default="none", help="flash profile: none, ufs3.1, ufs4.0")
    parser.add_argument(
        "--draft",
        type=Path,
        default=None,
        help="draft model for SD modes (default: the real 0.5B draft GGUF, fetched on first use)",
    )
    parser.add_argument("--draft-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--chain", default="4", help="sd-chain lengths to run, e.g. 2,4,6,8")
    parser.add_argument("--static-tree", default="4,2,2,1", help="sd-static widths per depth")
    parser.add_argument(
        "--prompt-sets", default="humaneval", help=f"comma-separated: {PROMPT_SETS}"
    )
    parser.add_argument("--prompts", type=int, default=5, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="compute dtype of memory-resident modes (default: the layout's)",
    )
    parser.add_argument("--seed", type=int, default=0, help="picks the prompts")
    parser.add_argument("--out", type=Path, default=Path("bench/results/latest.json"))
    parser.set_defaults(command=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    from lever_actors.bench.harness import PromptSet, markdown_table, run_bench
    from lever_actors.bench.prompts import load_prompts
    from lever_actors.bench.results import write_results
    from lever_actors.checkpoints import load_checkpoint
    from lever_actors.cli import DTYPES, cache_dir, raise_usage, real_target_layout
    from lever_actors.device.disk_profile import profile_disk
    from lever_actors.device.layout import MANIFEST_NAME, WEIGHTS_NAME, read_manifest

    modes_wanted = args.modes.split(",")
    unknown = sorted(set(modes_wanted) - set(MODES))
    if unknown:
        raise_usage(f"unknown bench mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    target_path = args.target or real_target_layout(args)
    manifest = read_manifest(target_path) if (target_path / MANIFEST_NAME).is_file() else None
    if manifest is None and set(modes_wanted) - {"memory-ar", "peer-memory"}:
        raise_usage(f"flash modes need a flash layout as --target; {target_path} is not one")
    dtype = DTYPES[args.dtype] if args.dtype else (manifest.torch_dtype if manifest else None)
    if dtype is None:
        raise_usage("--dtype is needed when --target is not a flash layout")
    target = load_checkpoint(target_path, dtype)
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise_usage(f"{target_path} has no tokenizer")
    prompt_sets = [
        PromptSet(
            name,
            [
                tokenizer.encode(tokenizer.apply_chat_template(text))
                for text in load_prompts(name, cache_dir(args), args.prompts, args.seed)
            ],
        )
        for name in args.prompt_sets.split(",")
    ]
    modes = build_modes(args, modes_wanted, target, target_path, manifest, dtype)
    disk = []
    if manifest is not None:
        layer_bytes = max(manifest.layer(i).nbytes for i in range(manifest.args.n_layers))
        disk.append(profile_disk(target_path / WEIGHTS_NAME, layer_bytes))
    config = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "command"
    }
    results = trio.run(
        functools.partial(
            run_bench,
            modes,
            prompt_sets,
            max_new_tokens=args.max_new_tokens,
            stop_ids=tokenizer.eos_ids,
            config=config,
        )
    )
    if manifest is not None:
        disk.append(profile_disk(target_path / WEIGHTS_NAME, layer_bytes))
    results = msgspec.structs.replace(results, disk=disk)
    write_results(results, args.out)
    print(markdown_table(results))
    for profile in disk:
        print(f"raw disk: {profile.bandwidth / 1e9:.2f} GB/s ({profile.mode})")
    for name, ratio in results.ratios.items():
        print(f"{name}: {ratio:.3f}")
    print(f"results: {args.out}", file=sys.stderr)
    return 0


def engine_variants(args: argparse.Namespace, name: str) -> list[tuple[str, dict]]:
    """(mode name, EngineConfig fields) for an engine-backed mode. Conventional SD runs with
    the pruner and the gain-cost policy off; the Lever ablations turn one policy off each."""
    conventional = {"early_exit": "off", "projection": "on_demand", "units": "single"}
    static = f"static:{args.static_tree}"
    variants = {
        "flash-ar": [("flash-ar", {"tree": "none", "early_exit": "off"})],
        "sd-chain": [
            (f"sd-chain:{k}", {"tree": f"chain:{k}", **conventional}) for k in args.chain.split(",")
        ],
        "sd-static": [(f"sd-{static}", {"tree": static, **conventional})],
        "lever": [("lever", {})],
        "lever-no-gaincost": [("lever-no-gaincost", {"tree": static})],
        "lever-no-prune": [("lever-no-prune", {"early_exit": "off"})],
        "lever-eager": [("lever-eager", {"projection": "eager"})],
        "lever-single-unit": [("lever-single-unit", {"units": "single"})],
    }
    return variants[name]


def build_modes(args, wanted, target, target_path, manifest, dtype) -> list:
    """The modes to compare, in the order asked; engine modes get one per budget (and per
    chain length); the draft is loaded once and shared."""
    from lever_actors.bench.modes import EngineMode, MemoryAR, PeerMemory
    from lever_actors.cli import real_model_path
    from lever_actors.config import EngineConfig
    from lever_actors.engine import load_draft

    draft = None
    if set(wanted) - {"memory-ar", "peer-memory", "flash-ar"}:
        draft_path = args.draft or real_model_path(args, "draft")
        draft = load_draft(str(draft_path), args.draft_dtype)
    modes = []
    for name in wanted:
        if name == "memory-ar":
            modes.append(MemoryAR(target))
        elif name == "peer-memory":
            modes.append(PeerMemory(Path(manifest.source) if manifest else target_path, dtype))
        else:
            for mode_name, fields in engine_variants(args, name):
                for label in args.budgets.split(","):
                    config = EngineConfig(
                        target=str(target_path),
                        throttle=args.throttle,
                        dram_budget=label,
                        draft_dtype=args.draft_dtype,
                        **fields,
                    )
                    modes.append(EngineMode(f"{mode_name}@{label}", config, draft))
    return modes
