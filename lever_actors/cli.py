"""The `lever-actors` command: generate, fetch-models, convert, profile-disk, train-exit,
bench, report, check-exact, export-hf."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import msgspec
import structlog
import torch
import trio

from lever_actors.bench.cli import (
    add_bench_arguments,
    add_check_exact_arguments,
    add_report_arguments,
    apply_config,
)
from lever_actors.channels.stats import decode_phase, decode_rate, per_step
from lever_actors.checkpoints import load_checkpoint
from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.export import export_hf
from lever_actors.checkpoints.fetch import REAL_MODELS, default_cache_dir
from lever_actors.checkpoints.prompts import load_prompts
from lever_actors.checkpoints.real_pair import real_model_path, real_target_layout
from lever_actors.config import (
    DEFAULT_MAX_NEW_TOKENS,
    EngineConfig,
    check_max_new_tokens,
    choices_of,
    default_of,
)
from lever_actors.device.disk_profile import profile_disk
from lever_actors.device.layout import MANIFEST_NAME, WEIGHTS_NAME, read_manifest
from lever_actors.engine import Engine
from lever_actors.errors import ConfigError, LeverError
from lever_actors.model.greedy import greedy_stream
from lever_actors.model.transformer import Transformer
from lever_actors.policy import exit_training as et
from lever_actors.progress import ProgressLine
from lever_actors.sizes import format_bytes, parse_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
STORE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    try:
        if getattr(args, "config", None) is not None:  # the file's values become defaults
            apply_config(args.bench_parser, args.config)
            args = parser.parse_args(argv)  # so that flags on the command line still win
        args.cache_dir = args.cache_dir or default_cache_dir()
        return args.command(args)
    except LeverError as e:
        print(f"lever-actors: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lever-actors", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where real models and prompt sets are kept (default: $XDG_CACHE_HOME/lever_actors)",
    )
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="stream greedy text: the pipeline (default: the real pair) or a model in DRAM",
    )
    gen.add_argument("--target", type=Path, help="flash layout of the target (from `convert`)")
    gen.add_argument("--draft", type=Path, help="draft model: HF dir, GGUF file or flash layout")
    gen.add_argument(
        "--tree",
        help="none, chain:K, static:W1,W2,... or gaincost[:CAP] (default: "
        f"{default_of('tree')} with a draft, else none)",
    )
    _option(gen, "early_exit", help="trained needs `train-exit` first")
    gen.add_argument("--exit-layer", type=int, help="default: 7/8 of the way through")
    _option(gen, "prune_threshold", type=float)
    _option(gen, "prune_when", help="compute_bound: only passes that compute, not flash, paces")
    gen.add_argument(
        "--no-draft-ahead",
        action="store_true",
        help="do not draft the next tree while the target verifies this one",
    )
    _option(gen, "draft_dtype")
    _option(gen, "projection")
    _option(gen, "units", help="split: small work on a second unit beside the batched one")
    gen.add_argument(
        "--dram-budget",
        help="target weights held in DRAM: 25%%, 1.5GiB or all (default: 25%% for the real "
        "pair, else all)",
    )
    _option(gen, "throttle", help="emulated phone flash")
    gen.add_argument("--verify", action="store_true", help="check tensor checksums as they load")
    gen.add_argument("--trace", type=Path, help="write every message between actors to FILE")
    gen.add_argument(
        "--model",
        type=Path,
        help="instead of the pipeline: HF dir, GGUF or flash layout held whole in DRAM",
    )
    gen.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="compute dtype with --model"
    )
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"(default: {DEFAULT_MAX_NEW_TOKENS})",
    )
    gen.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    gen.set_defaults(command=_generate)

    fetch = sub.add_parser("fetch-models", help="download, assemble and verify the real model pair")
    fetch.set_defaults(command=_fetch_models)

    conv = sub.add_parser("convert", help="write the flash layout of an HF directory or GGUF file")
    conv.add_argument("src", type=Path)
    conv.add_argument("out", type=Path)
    conv.add_argument("--dtype", choices=sorted(STORE_DTYPES), default="bf16")
    conv.set_defaults(command=_convert)

    prof = sub.add_parser("profile-disk", help="raw O_DIRECT sequential read bandwidth")
    prof.add_argument("path", type=Path, help="a file, or a flash layout (reads its weights)")
    prof.add_argument("--block-size", default=None, help="default: the layout's largest layer")
    prof.add_argument("--max-bytes", default="2GiB", help="stop after this much")
    prof.set_defaults(command=_profile_disk)

    train = sub.add_parser(
        "train-exit", help="train the early-exit predictor of a flash layout, saved beside it"
    )
    train.add_argument("layout", type=Path, help="the target's flash layout (from `convert`)")
    train.add_argument("--prompt-set", choices=["humaneval", "sharegpt"], default="humaneval")
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
    train.set_defaults(command=_train_exit)

    bench = sub.add_parser("bench", help="measure decoding modes on the real model pair")

    add_bench_arguments(bench)

    report = sub.add_parser(
        "report", help="markdown, plots and the README's Results section from a results JSON"
    )

    add_report_arguments(report)

    check = sub.add_parser(
        "check-exact",
        help="every speculative policy against one-token greedy of the same layout, on real "
        "prompts; exits 1 on any divergence",
    )
    add_check_exact_arguments(check)

    export = sub.add_parser(
        "export-hf", help="write an HF safetensors directory of a GGUF file or flash layout"
    )
    export.add_argument("src", type=Path, help="GGUF file, flash layout or HF directory")
    export.add_argument("out", type=Path)
    export.add_argument(
        "--dtype", choices=sorted(STORE_DTYPES), default=None, help="default: a layout's, else bf16"
    )
    export.set_defaults(command=_export_hf)
    return parser


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


def _configure_logging(verbose: bool) -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.INFO if verbose else logging.WARNING
        ),
        # looked up per logger: tests and tools swap sys.stderr after the CLI configured it
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),
    )


def _fetch_models(args: argparse.Namespace) -> int:

    for key in REAL_MODELS:
        print(f"{key}: {real_model_path(args.cache_dir, key, ProgressLine())}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    check_max_new_tokens(args.max_new_tokens)
    if args.model is not None:
        if args.target or args.draft:
            raise ConfigError(
                "--model runs a model held in DRAM; --target/--draft run the pipeline"
            )
        return _generate_in_memory(args)
    return _generate_with_engine(args)


def _generate_in_memory(args: argparse.Namespace) -> int:

    path = args.model
    started = time.perf_counter()
    checkpoint = load_checkpoint(path, DTYPES[args.dtype])
    prompt, printer = _prompt_and_printer(args, checkpoint.tokenizer, path)
    model = Transformer(checkpoint.args, checkpoint.weights)
    print(f"loaded {path.name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    printer.start()
    for token in greedy_stream(model, prompt, args.max_new_tokens, printer.stop_ids):
        printer(token)
    printer.finish()
    return 0


def _generate_with_engine(args: argparse.Namespace) -> int:
    """The pipeline: the target streamed from flash, the draft in DRAM. With neither given,
    the real pair (fetched and converted on first use)."""

    real = args.target is None
    target = args.target or real_target_layout(args.cache_dir, ProgressLine())
    draft = args.draft or (
        real_model_path(args.cache_dir, "draft", ProgressLine()) if real else None
    )
    tree = args.tree or ("gaincost" if draft else "none")
    config = EngineConfig(
        target=str(target),
        draft=str(draft) if draft and tree != "none" else None,
        tree=tree,
        dram_budget=args.dram_budget or ("25%" if real else "all"),
        throttle=args.throttle,
        verify_checksums=args.verify,
        early_exit=args.early_exit,
        exit_layer=args.exit_layer,
        prune_threshold=args.prune_threshold,
        prune_when=args.prune_when,
        draft_ahead=not args.no_draft_ahead,
        draft_dtype=args.draft_dtype,
        projection=args.projection,
        units=args.units,
        trace=str(args.trace) if args.trace else None,
    )
    return trio.run(_stream_from_engine, config, args)


async def _stream_from_engine(config, args: argparse.Namespace) -> int:

    started = time.perf_counter()
    async with Engine.open(config, progress=ProgressLine(unit="")) as engine:
        target, plan = engine.target, engine.target.plan
        if engine.tokenizer is None:
            raise ConfigError(f"{config.target} has no tokenizer; generate needs one")
        print(
            f"loaded in {time.perf_counter() - started:.1f} s: tree {config.tree}, "
            f"{len(plan.streamed_layers)}/{target.args.n_layers} target layers streamed "
            f"({target.store.mode}), {format_bytes(plan.used(target.manifest))} of target "
            "weights in DRAM",
            file=sys.stderr,
        )
        text = args.prompt if args.raw else engine.tokenizer.apply_chat_template(args.prompt)
        before = target.store.stats.bytes_read
        events = []
        async for event in engine.stream(text, max_new_tokens=args.max_new_tokens):
            events.append(event)
            sys.stdout.write(event.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        read = target.store.stats.bytes_read - before
    steps = len({e.step for e in events})
    rate = decode_rate(*decode_phase(events))
    print(
        f"{len(events)} tokens in {steps} steps ({per_step(len(events), steps):.2f} per step, "
        f"{sum(e.from_draft for e in events)} from the draft); first token after "
        f"{events[0].elapsed_seconds:.2f} s; decode {_rate_text(rate)}; "
        f"{format_bytes(read // len(events))} read per token",
        file=sys.stderr,
    )
    return 0


class _TokenPrinter:
    """Writes each token's text to stdout as it comes; the figures to stderr at the end."""

    def __init__(self, tokenizer, prompt_tokens: int) -> None:
        self.decoder = tokenizer.stream_decoder()
        self.stop_ids: frozenset[int] = tokenizer.eos_ids
        self.prompt_tokens = prompt_tokens
        self.count = 0

    def start(self) -> None:
        self.started = self.first = time.perf_counter()

    def __call__(self, token: int) -> None:
        if self.count == 0:
            self.first = time.perf_counter()
        self.count += 1
        sys.stdout.write(self.decoder.push(token))
        sys.stdout.flush()

    def finish(self) -> None:
        sys.stdout.write(self.decoder.flush() + "\n")
        rate = decode_rate(self.count - 1, time.perf_counter() - self.first)
        print(
            f"{self.count} tokens; prompt {self.prompt_tokens} tokens, first token after "
            f"{self.first - self.started:.2f} s; decode {_rate_text(rate)}",
            file=sys.stderr,
        )


def _rate_text(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.2f} tok/s"


def _prompt_and_printer(args: argparse.Namespace, tokenizer, path: Path):
    if tokenizer is None:
        raise ConfigError(f"{path} has no tokenizer; generate needs one to encode the prompt")
    text = args.prompt if args.raw else tokenizer.apply_chat_template(args.prompt)
    prompt = tokenizer.encode(text)
    return prompt, _TokenPrinter(tokenizer, len(prompt))


def _convert(args: argparse.Namespace) -> int:

    manifest = convert(args.src, args.out, STORE_DTYPES[args.dtype], ProgressLine())
    print(f"{args.out}: {manifest.args.n_layers} layers, {format_bytes(manifest.file_bytes)}")
    return 0


def _export_hf(args: argparse.Namespace) -> int:

    if args.dtype is not None:
        dtype = STORE_DTYPES[args.dtype]
    elif (args.src / MANIFEST_NAME).is_file():
        dtype = read_manifest(args.src).torch_dtype
    else:
        dtype = torch.bfloat16
    out = export_hf(args.src, args.out, dtype, progress=ProgressLine())
    print(f"{out}: HF safetensors directory ({str(dtype).removeprefix('torch.')})")
    return 0


def _profile_disk(args: argparse.Namespace) -> int:

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


def _train_exit(args: argparse.Namespace) -> int:

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


if __name__ == "__main__":
    sys.exit(main())
