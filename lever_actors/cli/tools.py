"""The CLI's model, disk and build tools: fetch-models, convert, export-hf, profile-disk,
train-exit, build-llamacpp."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import torch

from lever_actors.bench import llamacpp_build
from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.export import export_hf
from lever_actors.checkpoints.fetch import REAL_MODELS, fetch_model
from lever_actors.checkpoints.prompts import PROMPT_SETS, load_prompts
from lever_actors.cli.commands import help_of
from lever_actors.config import WEIGHTS_CHOICES, Weights
from lever_actors.device.disk_profile import profile_disk
from lever_actors.device.layout import DTYPE_NAMES, torch_dtype
from lever_actors.device.manifest import MANIFEST_NAME, WEIGHTS_NAME, read_manifest
from lever_actors.errors import ConfigError
from lever_actors.policy import exit_training as et
from lever_actors.progress import ProgressLine
from lever_actors.sizes import format_bytes, parse_bytes

STORE_DTYPES = ("bfloat16", "float16", "float32")  # DTYPE_NAMES a layout may store


def add_commands(sub: argparse._SubParsersAction) -> None:
    fetch = sub.add_parser("fetch-models", help=help_of("fetch-models"))
    fetch.add_argument(
        "--verify",
        action="store_true",
        help="hash the cached files even where their stamps vouch for them (re-fetch on mismatch)",
    )
    fetch.set_defaults(command=run_fetch_models)

    conv = sub.add_parser("convert", help=help_of("convert"))
    conv.add_argument("src", type=Path)
    conv.add_argument("out", type=Path)
    conv.add_argument("--dtype", choices=STORE_DTYPES, default="bfloat16")
    conv.add_argument(
        "--weights",
        choices=WEIGHTS_CHOICES,
        default=None,
        help="matrices: auto keeps a GGUF's precision class (Q4_K and Q6_K -> their own "
        "values, other 4-bit -> int4, 8-bit -> int8), q4/q4k/q6/q8 quantize every one, dense "
        "stores --dtype (default: auto for bfloat16, else dense)",
    )
    conv.set_defaults(command=run_convert)

    prof = sub.add_parser("profile-disk", help=help_of("profile-disk"))
    prof.add_argument("path", type=Path, help="a file, or a flash layout (reads its weights)")
    prof.add_argument("--block-size", default=None, help="default: the layout's largest layer")
    prof.add_argument("--max-bytes", default="2GiB", help="stop after this much")
    prof.set_defaults(command=run_profile_disk)

    train = sub.add_parser("train-exit", help=help_of("train-exit"))
    train.add_argument("layout", type=Path, help="the target's flash layout (from `convert`)")
    train.add_argument("--prompt-set", choices=sorted(PROMPT_SETS), default="humaneval")
    train.add_argument("--prompts", type=int, default=16, help="how many prompts to train on")
    train.add_argument(
        "--continue-tokens", type=int, default=32, help="also train on greedy continuations"
    )
    train.add_argument("--exit-layer", type=int, default=None, help="default: the middle one")
    train.add_argument("--rank", type=int, default=32)
    train.add_argument("--steps", type=int, default=300)
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--out", type=Path, help="default: LAYOUT/exit_predictor.safetensors")
    train.set_defaults(command=run_train_exit)

    export = sub.add_parser("export-hf", help=help_of("export-hf"))
    export.add_argument("src", type=Path, help="GGUF file, flash layout or HF directory")
    export.add_argument("out", type=Path)
    export.add_argument(
        "--dtype",
        choices=STORE_DTYPES,
        default=None,
        help="default: a layout's, else bfloat16",
    )
    export.set_defaults(command=run_export_hf)

    build = sub.add_parser("build-llamacpp", help=help_of("build-llamacpp"))
    build.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default: 2)")
    build.add_argument(
        "--force", action="store_true", help="rebuild even where a matching build is cached"
    )
    build.set_defaults(command=run_build_llamacpp_command)


def run_fetch_models(args: argparse.Namespace) -> int:
    for model in REAL_MODELS.values():
        path = fetch_model(model, args.cache_dir, progress=ProgressLine(), verify=args.verify)
        print(f"{model.key}: {path}")
    return 0


def run_convert(args: argparse.Namespace) -> int:
    dtype = DTYPE_NAMES[args.dtype]
    weights: Weights = args.weights or ("auto" if dtype == torch.bfloat16 else "dense")
    manifest = convert(args.src, args.out, dtype, ProgressLine(), weights)
    print(f"{args.out}: {manifest.args.n_layers} layers, {format_bytes(manifest.file_bytes)}")
    return 0


def run_export_hf(args: argparse.Namespace) -> int:
    if args.dtype is not None:
        dtype = DTYPE_NAMES[args.dtype]
    elif (args.src / MANIFEST_NAME).is_file():
        dtype = torch_dtype(read_manifest(args.src))
    else:
        dtype = torch.bfloat16
    out = export_hf(args.src, args.out, dtype, progress=ProgressLine())
    print(f"{out}: HF safetensors directory ({str(dtype).removeprefix('torch.')})")
    return 0


def run_profile_disk(args: argparse.Namespace) -> int:
    path, block = args.path, args.block_size
    if path.is_dir():
        manifest = read_manifest(path)
        path = path / WEIGHTS_NAME
        block = block or max(manifest.layer(i).nbytes for i in range(manifest.args.n_layers))
    profile = profile_disk(path, parse_bytes(block or "64MiB"), parse_bytes(args.max_bytes))
    print(
        f"{profile.path}: {profile.bandwidth / 1e9:.2f} GB/s ({profile.mode}, "
        f"{profile.bytes_read / 1e9:.2f} GB in {profile.block_bytes / 2**20:.1f} MiB blocks, "
        f"{profile.seconds:.2f} s)"
    )
    return 0


def run_train_exit(args: argparse.Namespace) -> int:
    prompts = load_prompts(args.prompt_set, args.cache_dir, args.prompts, args.seed)
    texts, stop_ids = et.chat_token_ids(args.layout, prompts)
    adapter, report = et.train_exit_predictor(
        args.layout,
        texts,
        args.exit_layer,
        rank=args.rank,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        progress=ProgressLine(unit=""),
        continue_tokens=args.continue_tokens,
        stop_ids=stop_ids,
    )
    path = et.save_adapter(adapter, args.out or et.predictor_path(args.layout))
    print(msgspec.json.format(msgspec.json.encode(report)).decode())
    print(f"held-out KD loss {report.lens_loss:.4f} (lens) -> {report.trained_loss:.4f}; {path}")
    return 0


def run_build_llamacpp_command(args: argparse.Namespace) -> int:
    if args.jobs < 1:
        raise ConfigError("--jobs must be at least 1")
    cached = None if args.force else llamacpp_build.find_build(args.cache_dir)
    build = cached or llamacpp_build.build_llamacpp(
        args.cache_dir, jobs=args.jobs, force=args.force, progress=ProgressLine(unit="")
    )
    state = "already built" if cached else "built"
    print(f"llama.cpp ({llamacpp_build.PACKAGE} {build.version}) {state}: {build.bin_dir}")
    for name in llamacpp_build.PROGRAMS:
        print(f"  {build.program(name)}")
    return 0
