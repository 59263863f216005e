"""`lever-actors check-exact`: every speculative policy against one-token greedy decoding of
the same layout, on real prompts; exits 1 on any divergence."""

from __future__ import annotations

import argparse
from pathlib import Path

from lever_actors.bench.exactness import POLICIES, audit_prompts, check_exact
from lever_actors.checkpoints.load import load_tokenizer
from lever_actors.checkpoints.prompts import PROMPT_SETS, load_prompts
from lever_actors.checkpoints.real_pair import real_model_path, real_target_layout
from lever_actors.cli.commands import help_of
from lever_actors.cli.engine_options import split
from lever_actors.config import DramBudget, check_max_new_tokens
from lever_actors.device.manifest import read_manifest
from lever_actors.errors import ConfigError
from lever_actors.progress import ProgressLine


def add_commands(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("check-exact", help=help_of("check-exact"))
    parser.add_argument(
        "--target", type=Path, default=None, help="flash layout (default: the real target's)"
    )
    parser.add_argument(
        "--draft", type=Path, default=None, help="draft model (default: the real 0.5B draft)"
    )
    parser.add_argument("--prompts", type=int, default=20, help="prompts to check (default: 20)")
    parser.add_argument(
        "--prompt-sets",
        default=",".join(PROMPT_SETS),
        help="sets taken in turn with the built-in repetitive prose (default: all)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=48, help="(default: 48)")
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated (default: all): {', '.join(POLICIES)}",
    )
    parser.add_argument(
        "--dram-budget",
        default="all",
        help="target weights in DRAM; exactness does not depend on it (default: all)",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="requests decoding at once (EngineConfig.parallel): every prompt is sent at "
        "once, so that each one's trees share passes with others' (default: 1, in turn)",
    )
    parser.add_argument("--seed", type=int, default=0, help="picks the prompts")
    parser.set_defaults(command=run_check_exact_command)


def run_check_exact_command(args: argparse.Namespace) -> int:
    check_max_new_tokens(args.max_new_tokens)
    budget = DramBudget.parse(args.dram_budget)
    target = args.target or real_target_layout(args.cache_dir, ProgressLine())
    draft = args.draft or real_model_path(args.cache_dir, "draft", ProgressLine())
    tokenizer = load_tokenizer(target)
    if tokenizer is None:
        raise ConfigError(f"{target} has no tokenizer; check-exact needs one for the prompts")
    texts = {
        name: load_prompts(name, args.cache_dir, args.prompts, args.seed)
        for name in split(args.prompt_sets)
    }
    prompts = audit_prompts(tokenizer, texts, args.prompts)
    policies = split(args.policies)
    divergences = check_exact(
        target,
        draft,
        prompts,
        policies=policies,
        max_new_tokens=args.max_new_tokens,
        dram_budget=budget,
        parallel=args.parallel,
    )
    for d in divergences:
        print(
            f"DIVERGED {d.prompt} {d.policy}: token {d.position}: one-token greedy "
            f"{d.expected} {tokenizer.decode(d.expected)!r}, engine {d.got} "
            f"{tokenizer.decode(d.got)!r}"
        )
    runs = len(prompts) * len(policies)
    together = f", {args.parallel} at once" if args.parallel > 1 else ""
    print(
        f"check-exact: {len(prompts)} prompts x {len(policies)} policies = {runs} runs"
        f"{together}, {args.max_new_tokens} tokens each, target {target.name} "
        f"({read_manifest(target).dtype}): {len(divergences)} divergences"
    )
    return 1 if divergences else 0
