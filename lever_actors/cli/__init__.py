"""The `lever-actors` command: generate (cli/generate.py); serve (cli/serve.py);
fetch-models, convert, export-hf, profile-disk, train-exit (cli/tools.py); bench, report,
check-exact (bench/cli.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lever_actors import __version__
from lever_actors.bench.cli import (
    add_bench_arguments,
    add_check_exact_arguments,
    add_report_arguments,
    apply_config,
)
from lever_actors.checkpoints.fetch import default_cache_dir
from lever_actors.cli.generate import add_generate_command
from lever_actors.cli.serve import add_serve_command
from lever_actors.cli.tools import add_tool_commands
from lever_actors.errors import LeverError
from lever_actors.logs import log_to_stderr


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    log_to_stderr(args.verbose)
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
    parser.add_argument("--version", action="version", version=f"lever-actors {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where real models and prompt sets are kept (default: $XDG_CACHE_HOME/lever_actors)",
    )
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    add_generate_command(sub)
    add_serve_command(sub)
    add_tool_commands(sub)

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

    for command in sub.choices.values():  # -v after the command too; unset, the top's stands
        command.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log progress"
        )
    return parser


if __name__ == "__main__":
    sys.exit(main())
