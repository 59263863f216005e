"""`lever-actors generate`: stream text from the pipeline (default: the real pair) or from a
model held whole in DRAM, with the figures to stderr at the end. `--plan ar` on a target the
plain kernels run, held whole in DRAM, decodes without torch (cli/generate_plain.py); the
rest runs on torch (cli/generate_engine.py), which only then loads."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import msgspec

from lever_actors.checkpoints.tokenizer import check_messages, user_turn
from lever_actors.cli.commands import help_of
from lever_actors.cli.engine_options import (
    add_engine_arguments,
    add_sampling_arguments,
    sampling_of,
)
from lever_actors.cli.generate_plain import generate_plain, plain_run
from lever_actors.config import DEFAULT_MAX_NEW_TOKENS, check_prompt
from lever_actors.errors import ConfigError
from lever_actors.model.sampling import seed_or_drawn
from lever_actors.options import GenerationOptions
from lever_actors.threads import settle_policy

DTYPES = ("float32", "bfloat16", "float64")  # --model computes in one of these
DEFAULT_CHAT = "Write a Python function that returns the n-th Fibonacci number."


def add_commands(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help=help_of("generate"))
    add_engine_arguments(gen)
    gen.add_argument(
        "--model",
        type=Path,
        help="instead of the pipeline: HF dir, GGUF or flash layout held whole in DRAM",
    )
    gen.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="compute dtype with --model (default: float32)",
    )
    given = gen.add_argument_group(
        "what to continue (default: --chat with a coding request)",
        "--prompt is raw text, as the library's prompt=; --chat and --messages go through the "
        "model's chat template, as its messages=. TEXT or FILE '-' reads stdin.",
    )
    given.add_argument("--prompt", metavar="TEXT", help="raw text to continue, no chat template")
    given.add_argument("--chat", metavar="TEXT", help="one user message")
    given.add_argument(
        "--messages",
        metavar="FILE",
        help='a JSON list of {"role": "system"|"user"|"assistant", "content": TEXT}',
    )
    given.add_argument("--system", metavar="TEXT", help="a system message before --chat's")
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"(default: {DEFAULT_MAX_NEW_TOKENS})",
    )
    sampling = gen.add_argument_group(
        "sampling", "temperature 0 is greedy; above it, output equals sequential sampling"
    )
    add_sampling_arguments(sampling)
    sampling.add_argument("--seed", type=int, help="(default: drawn, and reported)")
    gen.add_argument(
        "--stats",
        choices=["text", "json"],
        default="text",
        help="the figures at the end, on stderr: a line, or one JSON object (default: text)",
    )
    gen.set_defaults(command=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    # everything the request can be checked for without a tokenizer, before models load
    options = GenerationOptions(
        max_new_tokens=args.max_new_tokens, sampling=sampling_of(args, seed_or_drawn(args.seed))
    )
    prompt, messages = _what_to_continue(args)
    if prompt is not None:
        check_prompt(len(prompt))
    if args.model is not None and (args.target or args.draft):
        raise ConfigError("--model runs a model held in DRAM; --target/--draft run the pipeline")
    plain = plain_run(args, options)
    if plain is not None:
        summary = generate_plain(plain, args, prompt, messages, options)
    else:  # torch's paths, loaded only here: the plain one never imports torch
        settle_policy()  # OpenMP loads with torch
        on_torch = importlib.import_module("lever_actors.cli.generate_engine")
        run = on_torch.generate_in_memory if args.model else on_torch.generate_with_engine
        summary = run(args, prompt, messages, options)
    if args.stats == "json":
        print(msgspec.json.encode(summary).decode(), file=sys.stderr)
    else:
        print(summary.line(), file=sys.stderr)
        if summary.finish_reason == "length":
            print(f"stopped at --max-new-tokens {args.max_new_tokens}", file=sys.stderr)
    return 0


def _what_to_continue(args: argparse.Namespace) -> tuple[str | None, list[dict] | None]:
    """(raw prompt, None) for --prompt, else (None, the conversation)."""
    if args.prompt is not None:
        if args.chat is not None or args.messages is not None or args.system is not None:
            raise ConfigError(
                "--prompt is raw text: it does not combine with --chat, --messages or --system"
            )
        return _text("--prompt", args.prompt), None
    if args.chat is not None and args.messages is not None:
        raise ConfigError("give --chat or --messages, not both")
    if args.messages is not None:
        source = args.messages
        try:
            raw = sys.stdin.read() if source == "-" else Path(source).read_text()
            messages = check_messages(json.loads(raw))
        except (OSError, ValueError) as cause:
            raise ConfigError(f"--messages {source}: {cause}") from cause
    else:
        messages = user_turn(_text("--chat", args.chat if args.chat is not None else DEFAULT_CHAT))
    if args.system is not None:
        if messages[0]["role"] == "system":
            raise ConfigError("--messages already starts with a system message")
        system = _text("--system", args.system, stdin=False)
        messages = [{"role": "system", "content": system}, *messages]
    return None, messages


def _text(flag: str, value: str, *, stdin: bool = True) -> str:
    """The flag's text (stdin's for '-', where `stdin`), which must be UTF-8: Python hands
    undecodable bytes of argv (and of stdin in the C locale) over as surrogates."""
    try:
        text = sys.stdin.read() if stdin and value == "-" else value
        text.encode()  # strict: a surrogate raises
    except (UnicodeEncodeError, UnicodeDecodeError) as cause:
        raise ConfigError(f"{flag}: not valid UTF-8 text (at position {cause.start})") from None
    return text
