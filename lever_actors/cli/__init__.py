"""The `lever-actors` command: generate (cli/generate.py); serve (cli/serve.py);
fetch-models, convert, export-hf, profile-disk, train-exit, build-llamacpp (cli/tools.py);
bench (cli/bench.py), report (cli/report.py), check-exact (cli/check_exact.py).

Exit codes: 0 done, 1 a runtime failure, 2 a usage error, 130 interrupted; an expected
failure prints one line (and its traceback under -v), a bug its traceback."""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Collection, Iterator
from pathlib import Path

from lever_actors import __version__
from lever_actors.cli.commands import command_in, help_of, modules
from lever_actors.errors import INTERRUPTED, ConfigError, LeverError
from lever_actors.logs import log_to_stderr
from lever_actors.paths import default_cache_dir

USAGE, RUNTIME = 2, 1  # argparse exits with USAGE on a bad flag itself
# The one place failures become exit codes, first match wins: a bad value the user gave,
# then what went wrong at run time (a checkpoint, a download, a file, undecodable input).
# Any other exception is a bug and keeps its traceback.
EXIT_CODES: tuple[tuple[type[Exception], int], ...] = (
    (ConfigError, USAGE),
    (LeverError, RUNTIME),
    (OSError, RUNTIME),
    (UnicodeError, RUNTIME),
)
_EXPECTED = tuple(kind for kind, _ in EXIT_CODES)


def main(argv: list[str] | None = None) -> int:
    command = command_in(sys.argv[1:] if argv is None else argv)
    parser = _parser(() if command is None else (command,))
    args = parser.parse_args(argv)
    log_to_stderr(args.verbose)
    try:
        if getattr(args, "config", None) is not None:  # the file's values become defaults
            args.apply_config(args.bench_parser, args.config)
            args = parser.parse_args(argv)  # so that flags on the command line still win
        args.cache_dir = args.cache_dir or default_cache_dir()
        return args.command(args)
    except BaseException as raised:  # trio hands failures on in exception groups: see _sole
        error = _sole(raised)
        if isinstance(error, KeyboardInterrupt):
            _report("interrupted", args.verbose)
            return INTERRUPTED
        if isinstance(error, _EXPECTED):
            _report(f"error: {_message(error)}", args.verbose)
            return _exit_code(error)
        raise


def _sole(error: BaseException) -> BaseException:
    """What failed, out of any exception groups around it: an interrupt among their
    exceptions, else their only one; `error` itself where it holds several (a bug's
    traceback shows them all)."""
    leaves = list(_leaves(error))
    interrupt = next((e for e in leaves if isinstance(e, KeyboardInterrupt)), None)
    return interrupt or (leaves[0] if len(leaves) == 1 else error)


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def _exit_code(error: Exception) -> int:
    """The exit code of an expected failure (see EXIT_CODES)."""
    return next(code for kind, code in EXIT_CODES if isinstance(error, kind))


def _message(error: Exception) -> str:
    """One line; an OS error names its file first, as our own errors do."""
    if isinstance(error, OSError) and error.filename is not None:
        paths = " -> ".join(str(p) for p in (error.filename, error.filename2) if p is not None)
        return f"{paths}: {error.strerror or error}"
    return str(error)


def _report(what: str, verbose: bool) -> None:
    if verbose:
        traceback.print_exc()
    print(f"lever-actors: {what}", file=sys.stderr)


def _parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with only `commands` given their arguments (their modules
    imported) and the others their line in --help."""
    parser = argparse.ArgumentParser(prog="lever-actors", description=__doc__)
    parser.add_argument("--version", action="version", version=f"lever-actors {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log progress, and a failure's traceback"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where real models and prompt sets are kept (default: $XDG_CACHE_HOME/lever_actors)",
    )
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    for module, names in modules().items():
        if commands is None or not set(names).isdisjoint(commands):
            importlib.import_module(f"lever_actors.cli.{module}").add_commands(sub)
        else:
            for name in names:
                sub.add_parser(name, help=help_of(name))

    for command in sub.choices.values():  # -v after the command too; unset, the top's stands
        command.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log progress"
        )
    return parser


if __name__ == "__main__":
    sys.exit(main())
