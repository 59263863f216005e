"""`lever-actors bench`: decoding modes side by side on real prompts, results to JSON,
markdown and PNGs (`--sweep` for the scaling sweep, `--parallel` for requests at once);
its options may also come from a TOML file."""

from __future__ import annotations

import argparse
import shlex
import sys
import tomllib
from pathlib import Path

from lever_actors.bench.harness import PromptSet, Workload
from lever_actors.bench.llamacpp import DEFAULT_DRAFT_MAX, DEFAULT_THREADS
from lever_actors.bench.plan import MODES, NEEDS_DRAFT, BenchOptions
from lever_actors.bench.report import render_markdown
from lever_actors.bench.results import AnyResults
from lever_actors.bench.run import (
    SWEEP_BUDGETS,
    SWEEP_FAMILIES,
    SWEEP_THROTTLES,
    bench,
    sweep,
)
from lever_actors.checkpoints.load import load_tokenizer
from lever_actors.checkpoints.prompts import PROMPT_SETS, load_prompts
from lever_actors.checkpoints.real_pair import real_model_path, real_target_layout
from lever_actors.checkpoints.tokenizer import user_turn
from lever_actors.cli.commands import help_of
from lever_actors.cli.engine_options import add_sampling_arguments, sampling_of, split
from lever_actors.config import DEFAULT_MAX_NEW_TOKENS, DramBudget, choices_of, default_of
from lever_actors.errors import ConfigError
from lever_actors.progress import ProgressLine

DEFAULT_MODES = "memory-ar,flash-ar"
DEFAULT_PROMPT_SETS = "humaneval"
DEFAULT_PROMPTS = 5
# --parallel: both prompt sets mixed, under the limits (#49)
PARALLEL_PROMPT_SETS = "humaneval,sharegpt"
PARALLEL_LIMITS = "1GiB,3GiB"


def add_commands(sub: argparse._SubParsersAction) -> None:
    add_bench_arguments(sub.add_parser("bench", help=help_of("bench")))


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a TOML file of these options (e.g. benchmarks/headline.toml); flags given here win",
    )
    parser.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated, the first is the agreement reference (default: {DEFAULT_MODES}; "
        f"with --sweep: flash-ar,sd-chain,sd-static,lever); known: {', '.join(MODES)}",
    )
    parser.add_argument(
        "--target",
        type=Path,
        default=None,
        help="the target: a flash layout (needed by flash and peer-offload modes), or a GGUF "
        "file / HF directory for memory modes (default: the real 1.5B target's layout with its "
        "GGUF's quantized weights, made once)",
    )
    parser.add_argument(
        "--budgets",
        default="25%,50%,100%",
        help="DRAM budgets for flash and peer-offload modes: percentages of the target's "
        "weights or sizes (1.5GiB); the first is the one the summary compares at",
    )
    parser.add_argument(
        "--throttle",
        default=default_of("throttle"),
        choices=choices_of("throttle"),
        help="flash profile",
    )
    parser.add_argument(
        "--draft",
        type=Path,
        default=None,
        help="draft model for SD modes (default: the real 0.5B draft GGUF, fetched on first use)",
    )
    parser.add_argument(
        "--draft-dtype", choices=choices_of("draft_dtype"), default=default_of("draft_dtype")
    )
    parser.add_argument("--chain", default="4", help="sd-chain lengths to run, e.g. 2,4,6,8")
    parser.add_argument("--static-tree", default="4,2,2,1", help="sd-static widths per depth")
    parser.add_argument(
        "--prune-threshold",
        type=float,
        default=None,
        help="early-exit threshold of the Lever modes (default: the engine's)",
    )
    parser.add_argument(
        "--prompt-sets",
        default=None,
        help=f"comma-separated: {','.join(PROMPT_SETS)} (default: {DEFAULT_PROMPT_SETS}; with "
        f"--parallel: {PARALLEL_PROMPT_SETS}, mixed)",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=None,
        help=f"prompts per set (default: {DEFAULT_PROMPTS}; with --parallel: enough for its "
        "largest count)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="compute dtype of memory-resident modes (default: the layout's)",
    )
    parser.add_argument("--seed", type=int, default=0, help="picks the prompts, and samples")
    add_sampling_arguments(
        parser.add_argument_group("sampling", "every mode samples alike; --seed seeds it")
    )
    parser.add_argument(
        "--isolate",
        nargs="?",
        const="all",
        default="none",
        choices=("none", "peers", "all"),
        help="all (the flag alone): run each mode in its own child process, under a cgroup "
        "memory limit where the machine allows (root + a cgroup memory controller), peak RSS "
        "per mode either way; peers: only the transformers and llama.cpp peers, whose reads "
        "go through the page cache, so ours can run interleaved beside them in this process "
        "(llama.cpp's own processes go under the limit, not a Python child)",
    )
    parser.add_argument(
        "--order",
        choices=("interleaved", "sequential"),
        default=None,
        help="interleaved: modes take turns on each prompt, so machine drift hits all alike "
        "(the modes of one --limits limit open at once); sequential: one mode at a time over "
        "all prompts (one mode's memory at a time). Default: interleaved, sequential with "
        "--isolate all and no --limits",
    )
    parser.add_argument(
        "--memory-limit",
        default=None,
        help="with --isolate: one memory limit for every mode (default: the mode's target "
        "budget + the draft's weights + --memory-overhead)",
    )
    parser.add_argument(
        "--memory-overhead", default="1GiB", help="runtime headroom in the default limit"
    )
    parser.add_argument(
        "--limits",
        default=None,
        help="memory limits as the run's axis, e.g. 1GiB,1.25GiB,3GiB: every mode but the "
        "memory-resident ones runs under each in a child (--isolate all), ours with "
        "--dram-budget auto and lever with --plan auto (--budgets is then unused); named "
        "mode@limit",
    )
    parser.add_argument(
        "--parallel",
        default=None,
        help="requests at once, e.g. 1,2,4,8 (1 among them): under each of --limits (default: "
        f"{PARALLEL_LIMITS}), Lever's engine opened to decode that many together and "
        "llama-server with as many slots, without and with its draft, each sent rounds of that "
        "many different prompts at once; --modes is then unused (default: "
        "benchmarks/results/concurrency.json)",
    )
    llamacpp = parser.add_argument_group(
        "llama.cpp", "the llamacpp-ar and llamacpp-spec modes (built by `build-llamacpp`)"
    )
    llamacpp.add_argument(
        "--llamacpp-draft-max",
        type=int,
        default=DEFAULT_DRAFT_MAX,
        help=f"llamacpp-spec: most tokens drafted per step (default: {DEFAULT_DRAFT_MAX})",
    )
    llamacpp.add_argument(
        "--llamacpp-threads",
        type=int,
        default=DEFAULT_THREADS,
        help=f"threads of llama.cpp (default: {DEFAULT_THREADS})",
    )
    llamacpp.add_argument(
        "--llamacpp-bin",
        default=None,
        help="a directory holding llama-completion, llama-speculative-simple and llama-server "
        "(default: the build in the cache)",
    )
    llamacpp.add_argument(
        "--llamacpp-target",
        default=None,
        help="the target GGUF llama.cpp runs (default: --target if a GGUF, else the GGUF "
        "its flash layout was converted from)",
    )
    llamacpp.add_argument(
        "--llamacpp-draft",
        default=None,
        help="the draft GGUF of llamacpp-spec (default: --draft if a GGUF, else its source)",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="scaling sweep: flash-ar, best SD and lever over --sweep-budgets x --sweep-throttles",
    )
    parser.add_argument("--sweep-budgets", default=",".join(map(str, SWEEP_BUDGETS)))
    parser.add_argument("--sweep-throttles", default=",".join(SWEEP_THROTTLES))
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results JSON; .md and .png files go beside it (default: "
        "benchmarks/results/latest.json, benchmarks/results/sweep.json with --sweep)",
    )
    parser.set_defaults(command=run_bench_command, bench_parser=parser, apply_config=apply_config)


def apply_config(parser: argparse.ArgumentParser, path: Path) -> None:
    """Make the options in a TOML file the bench parser's defaults. Keys are the option
    names (max-new-tokens or max_new_tokens); a list stands for a comma-separated value."""
    try:
        table = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read bench config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"bench config {path} is not valid TOML: {e}") from None
    # argparse lists its options only in _actions; the names and choices are what we need
    known = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    known.pop("config")
    defaults = {}
    for key, value in table.items():
        dest = key.replace("-", "_")
        if dest not in known:
            raise ConfigError(
                f"bench config {path}: unknown option {key!r}; known: "
                + ", ".join(sorted(d.replace("_", "-") for d in known))
            )
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        action = known[dest]
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(action.choices)
            raise ConfigError(f"bench config {path}: {key} must be one of {choices}")
        # argparse converts string defaults with the option's type, as it does flags
        defaults[dest] = value
    parser.set_defaults(**defaults)


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    parallel = tuple(int(n) for n in split(args.parallel)) if args.parallel else ()
    if parallel and args.sweep:
        raise ConfigError("--parallel and --sweep are runs of their own: give one")
    modes = args.modes or (",".join(SWEEP_FAMILIES) if args.sweep else DEFAULT_MODES)
    modes = "lever" if parallel else modes  # ours there is Lever, as --limits runs it
    prompt_sets = split(
        args.prompt_sets or (PARALLEL_PROMPT_SETS if parallel else DEFAULT_PROMPT_SETS)
    )
    prompts = args.prompts
    if prompts is None:
        prompts = -(-max(parallel) // len(prompt_sets)) if parallel else DEFAULT_PROMPTS
    limits = split(args.limits or (PARALLEL_LIMITS if parallel else ""))
    isolate = "all" if limits and args.isolate == "none" else args.isolate  # limits need children
    return BenchOptions(
        modes=split(modes),
        budgets=tuple(DramBudget.parse(b) for b in split(args.budgets)),
        throttle=args.throttle,
        chain=tuple(int(k) for k in split(args.chain)),
        static_tree=args.static_tree,
        prune_threshold=args.prune_threshold,
        draft_dtype=args.draft_dtype,
        dtype=args.dtype,
        prompt_sets=prompt_sets,
        prompts=prompts,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        sampling=sampling_of(args, args.seed),
        isolate=isolate,
        # under limits, sequential order let a minute of machine drift land on one mode: the
        # plan regret it showed (1.81) was 1.04 interleaved (docs/benchmarks.md)
        order=args.order or ("sequential" if isolate == "all" and not limits else "interleaved"),
        memory_limit=args.memory_limit,
        memory_overhead=args.memory_overhead,
        limits=limits,
        parallel=parallel,
        cache_dir=str(args.cache_dir),
        llamacpp_draft_max=args.llamacpp_draft_max,
        llamacpp_threads=args.llamacpp_threads,
        llamacpp_bin=args.llamacpp_bin,
        llamacpp_target=args.llamacpp_target,
        llamacpp_draft=args.llamacpp_draft,
    )


def run_bench_command(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    target = args.target or real_target_layout(args.cache_dir, ProgressLine())
    draft = args.draft
    if draft is None and set(options.modes) & set(NEEDS_DRAFT):
        draft = real_model_path(args.cache_dir, "draft", ProgressLine())
    tokenizer = load_tokenizer(target)
    if tokenizer is None:
        raise ConfigError(f"{target} has no tokenizer; bench needs one to encode the prompts")
    prompt_sets = [
        PromptSet(
            name,
            [
                tokenizer.encode(tokenizer.apply_chat_template(user_turn(text)))
                for text in load_prompts(name, args.cache_dir, options.prompts, options.seed)
            ],
        )
        for name in options.prompt_sets
    ]
    workload = Workload(target, draft, prompt_sets, tokenizer.eos_ids)
    command = shlex.join(["lever-actors", *sys.argv[1:]])
    plots = not args.no_plots
    results: AnyResults
    if args.sweep:  # not with --parallel (options_from_args)
        out = args.out or Path("benchmarks/results/sweep.json")
        budgets = tuple(DramBudget.parse(b) for b in split(args.sweep_budgets))
        throttles = split(args.sweep_throttles)
        results = sweep(
            options,
            workload,
            budgets=budgets,
            throttles=throttles,
            out=out,
            command=command,
            plots=plots,
        )
    else:
        default = "concurrency.json" if options.parallel else "latest.json"
        out = args.out or Path("benchmarks/results") / default
        results = bench(options, workload, out=out, command=command, plots=plots)
    print(render_markdown(results))
    print(f"results: {out}", file=sys.stderr)
    return 0
