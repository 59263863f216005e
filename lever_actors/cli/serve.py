"""`lever-actors serve`: the engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import sys
from functools import partial

import trio

from lever_actors.cli.engine_options import add_engine_arguments, engine_config
from lever_actors.config import DEFAULT_MAX_NEW_TOKENS
from lever_actors.progress import ProgressLine
from lever_actors.serve import DRAIN_SECONDS, check_address, serve
from lever_actors.serve.app import DEFAULT_MAX_BODY
from lever_actors.sizes import compact_bytes, parse_bytes


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models",
    )
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="(default: 8000)")
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
        default=8,
        help="requests that may wait; more get 429 (default: 8)",
    )
    parser.add_argument(
        "--grace",
        type=seconds,
        default=DRAIN_SECONDS,
        help="seconds running requests get to finish after SIGTERM, before they are cut "
        f"(default: {DRAIN_SECONDS:g})",
    )
    parser.add_argument(
        "--max-body",
        type=parse_bytes,
        default=DEFAULT_MAX_BODY,
        metavar="SIZE",
        help=f"larger request bodies get 413 (default: {compact_bytes(DEFAULT_MAX_BODY)})",
    )
    parser.add_argument("--model-name", default="lever", help="the id /v1/models lists")
    parser.add_argument(
        "--max-tokens",
        type=positive,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"when a request gives none (default: {DEFAULT_MAX_NEW_TOKENS})",
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


def _at_least(n: int, least: int) -> int:
    if n < least:
        raise argparse.ArgumentTypeError(f"expected {least} or more, got {n}")
    return n


def run_serve(args: argparse.Namespace) -> int:
    check_address(args.host, args.port)  # before the real pair is fetched (minutes)
    config = engine_config(args)
    run = partial(
        serve,
        config,
        host=args.host,
        port=args.port,
        model_name=args.model_name,
        queue=args.queue,
        api_key=args.api_key,
        default_max_tokens=args.max_tokens,
        allowed_hosts=args.allowed_hosts,
        grace=args.grace,
        max_body=args.max_body,
        progress=ProgressLine(unit=""),
    )

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(run)
            print(f"serving {config.target} at {', '.join(binds)}", file=sys.stderr)

    trio.run(main)
    return 0
