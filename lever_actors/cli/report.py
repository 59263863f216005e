"""`lever-actors report`: markdown, plots and the README's Results section from a results
JSON written by `bench`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lever_actors.bench.plots import write_plots
from lever_actors.bench.report import (
    output_paths,
    readme_section,
    render_markdown,
    rewrite_readme,
)
from lever_actors.bench.results import BenchResults, read_results
from lever_actors.cli.commands import help_of
from lever_actors.errors import ConfigError


def add_commands(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("report", help=help_of("report"))
    parser.add_argument("results", type=Path, help="a results JSON written by `bench`")
    parser.add_argument(
        "--readme",
        type=Path,
        default=None,
        help="rewrite this file's section between <!-- results:start --> and "
        "<!-- results:end --> from the results",
    )
    parser.add_argument("--no-plots", action="store_true", help="do not redraw the PNGs")
    parser.set_defaults(command=run_report_command)


def run_report_command(args: argparse.Namespace) -> int:
    results = read_results(args.results)
    if not args.no_plots:
        for path in write_plots(results, args.results):
            print(f"plot: {path}", file=sys.stderr)
    markdown = render_markdown(results)
    output_paths(args.results)["markdown"].write_text(markdown)
    if args.readme is not None:
        if not isinstance(results, BenchResults):
            raise ConfigError(f"{args.results} holds sweep results; --readme takes a bench run's")
        rewrite_readme(args.readme, readme_section(results, args.readme, args.results))
        print(f"rewrote the results section of {args.readme}", file=sys.stderr)
    else:
        print(markdown)
    return 0
