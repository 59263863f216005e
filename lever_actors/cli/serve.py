"""`lever-actors serve`: the engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import sys
from functools import partial

import trio

from lever_actors.cli.commands import help_of
from lever_actors.cli.engine_config import engine_config
from lever_actors.cli.engine_options import add_engine_arguments
from lever_actors.engine import Engine
from lever_actors.progress import ProgressLine
from lever_actors.serve import DEFAULTS, check_address, serve
from lever_actors.serve.options import ServeOptions
from lever_actors.sizes import compact_bytes, parse_bytes


def add_commands(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("serve", help=help_of("serve"))
    add_engine_arguments(parser)
    parser.add_argument("--host", default=DEFAULTS.host, help=f"(default: {DEFAULTS.host})")
    parser.add_argument(
        "--port", type=int, default=DEFAULTS.port, help=f"(default: {DEFAULTS.port})"
    )
    parser.add_argument("--api-key", help="required as 'Authorization: Bearer KEY' when given")
    parser.add_argument(
        "--allowed-host",
        action="append",
        dest="allowed_hosts",
        metavar="NAME",
        help="a name the Host header may give, others get 421; repeatable (default: the "
        "loopback names where --host is loopback, else any)",
    )
    parser.add_argument(
        "--queue",
        type=count,
        default=DEFAULTS.queue,
        help="requests that may wait beside the --parallel ones decoding; more get 429 "
        f"(default: {DEFAULTS.queue})",
    )
    parser.add_argument(
        "--grace",
        type=seconds,
        default=DEFAULTS.grace,
        help="seconds running requests get to finish after SIGTERM, before they are cut "
        f"(default: {DEFAULTS.grace:g})",
    )
    parser.add_argument(
        "--max-body",
        type=parse_bytes,
        default=DEFAULTS.max_body,
        metavar="SIZE",
        help=f"larger request bodies get 413 (default: {compact_bytes(DEFAULTS.max_body)})",
    )
    parser.add_argument(
        "--deadline",
        type=positive_seconds,
        metavar="SECONDS",
        help="each request's time limit from its arrival: the step that ends after it is the "
        "last (finish_reason length); one still queued or in its prefill gets 504 "
        "(default: none)",
    )
    parser.add_argument("--model-name", default=DEFAULTS.model_name, help="the id /v1/models lists")
    parser.add_argument(
        "--max-tokens",
        type=positive,
        default=DEFAULTS.default_max_tokens,
        help=f"when a request gives none (default: {DEFAULTS.default_max_tokens})",
    )
    parser.set_defaults(command=run_serve)


# argparse types; each one's ValueError argparse reports as an invalid value
def count(text: str) -> int:
    """A whole number, 0 or more."""
    return _at_least(int(text), 0)


def positive(text: str) -> int:
    """A whole number, 1 or more."""
    return _at_least(int(text), 1)


def seconds(text: str) -> float:
    """A duration: 0 or more seconds (inf: no end)."""
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {text}")
    return value


def positive_seconds(text: str) -> float:
    """A duration of more than 0 seconds."""
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected more than 0 seconds, got {text}")
    return value


def _at_least(n: int, least: int) -> int:
    if n < least:
        raise argparse.ArgumentTypeError(f"expected {least} or more, got {n}")
    return n


def run_serve(args: argparse.Namespace) -> int:
    options = ServeOptions(
        host=args.host,
        port=args.port,
        model_name=args.model_name,
        queue=args.queue,
        api_key=args.api_key,
        default_max_tokens=args.max_tokens,
        allowed_hosts=args.allowed_hosts,
        grace=args.grace,
        max_body=args.max_body,
        deadline_seconds=args.deadline,
    )
    check_address(options.host, options.port)  # before the real pair is fetched (minutes)
    config = engine_config(args)
    run = partial(serve, config, options, progress=ProgressLine(unit=""), opened=_plans)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(run)
            print(f"serving {config.target} at {', '.join(binds)}", file=sys.stderr)

    trio.run(main)
    return 0


def _plans(engine: Engine) -> None:
    """How the engine shared out the memory and how it decodes, as `generate` prints them."""
    print(engine.plan, file=sys.stderr)
