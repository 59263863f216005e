"""`lever-actors bench`: decoding modes side by side on real prompts, results to JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from lever_actors.bench.prompts import PROMPT_SETS

MODES = ("memory-ar", "flash-ar", "peer-memory")


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
        help="flash layout of the target (default: the real 1.5B target in bf16, made once)",
    )
    parser.add_argument(
        "--budgets",
        default="25%,50%,100%",
        help="DRAM budgets for flash modes: percentages of the target's weights or sizes (1.5GiB)",
    )
    parser.add_argument("--throttle", default="none", help="flash profile: none, ufs3.1, ufs4.0")
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
    from lever_actors.bench.modes import FlashAR, MemoryAR, PeerMemory
    from lever_actors.bench.prompts import load_prompts
    from lever_actors.bench.results import write_results
    from lever_actors.checkpoints import load_checkpoint
    from lever_actors.cli import DTYPES, cache_dir, raise_usage, real_target_layout
    from lever_actors.device.disk_profile import profile_disk
    from lever_actors.device.layout import WEIGHTS_NAME, read_manifest

    modes_wanted = args.modes.split(",")
    unknown = sorted(set(modes_wanted) - set(MODES))
    if unknown:
        raise_usage(f"unknown bench mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    layout = args.target or real_target_layout(args)
    manifest = read_manifest(layout)
    dtype = DTYPES[args.dtype] if args.dtype else manifest.torch_dtype
    target = load_checkpoint(layout, dtype)
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise_usage(f"{layout} has no tokenizer")
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
    modes = []
    for name in modes_wanted:
        if name == "memory-ar":
            modes.append(MemoryAR(target))
        elif name == "peer-memory":
            modes.append(PeerMemory(Path(manifest.source), dtype))
        else:
            for label in args.budgets.split(","):
                budget = _budget(label, manifest.file_bytes)
                modes.append(FlashAR(layout, budget, label, args.throttle))
    layer_bytes = max(manifest.layer(i).nbytes for i in range(manifest.args.n_layers))
    disk = [profile_disk(layout / WEIGHTS_NAME, layer_bytes)]
    config = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "command"
    }
    results = run_bench(
        modes,
        prompt_sets,
        max_new_tokens=args.max_new_tokens,
        stop_ids=tokenizer.eos_ids,
        config=config,
    )
    disk.append(profile_disk(layout / WEIGHTS_NAME, layer_bytes))
    results = msgspec.structs.replace(results, disk=disk)
    write_results(results, args.out)
    print(markdown_table(results))
    for profile in disk:
        print(f"raw disk: {profile.bandwidth / 1e9:.2f} GB/s ({profile.mode})")
    for name, ratio in results.ratios.items():
        print(f"{name}: {ratio:.3f}")
    print(f"results: {args.out}", file=sys.stderr)
    return 0


def _budget(label: str, model_bytes: int) -> int:
    from lever_actors.device.budget import parse_bytes

    if label.endswith("%"):
        return int(model_bytes * float(label[:-1]) / 100)
    return parse_bytes(label)
