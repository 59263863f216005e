"""`lever-actors generate`: stream text from the pipeline (default: the real pair) or from a
model held whole in DRAM, with the figures to stderr at the end."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import msgspec
import trio

from lever_actors.channels.messages import FinishReason, TokenEvent
from lever_actors.channels.stats import decode_phase, decode_rate, per_step, prefill_rate
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.checkpoints.tokenizer import Tokenizer, check_messages, user_turn
from lever_actors.cli.commands import help_of
from lever_actors.cli.engine_options import (
    add_engine_arguments,
    add_sampling_arguments,
    engine_config,
    sampling_of,
)
from lever_actors.config import (
    DEFAULT_MAX_NEW_TOKENS,
    EngineConfig,
    check_prompt,
    check_request_size,
)
from lever_actors.device.layout import DTYPE_NAMES
from lever_actors.device.memory import peak_rss_bytes
from lever_actors.engine import Engine
from lever_actors.errors import ConfigError
from lever_actors.model.sampling import seed_or_drawn
from lever_actors.model.sequential import sequential_stream
from lever_actors.model.transformer import Transformer
from lever_actors.options import GenerationOptions
from lever_actors.progress import ProgressLine
from lever_actors.sizes import format_bytes
from lever_actors.text.finish import finish_reason

DTYPES = ("float32", "bfloat16", "float64")  # --model computes in one of these DTYPE_NAMES
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


class Summary(msgspec.Struct, omit_defaults=True):
    """What `--stats` reports after a generation."""

    prompt_tokens: int
    generated_tokens: int
    finish_reason: FinishReason | None
    first_token_seconds: float
    prefill_tokens_per_second: float | None  # the prompt's tokens over first_token_seconds
    decode_tokens_per_second: float | None
    peak_rss_bytes: int
    seed: int | None
    steps: int | None = None  # the pipeline's figures
    tokens_per_step: float | None = None
    from_draft: int | None = None
    bytes_read_per_token: int | None = None
    load_seconds: float | None = None  # the engine's start, models and policies
    cached_tokens: int | None = None  # the prompt's, whose KV the prompt cache held

    def line(self) -> str:
        rate = self.decode_tokens_per_second
        parts = [
            f"{self.generated_tokens} tokens ({self.finish_reason})",
            f"prompt {self.prompt_tokens} tokens"
            + (f" ({self.cached_tokens} cached)" if self.cached_tokens else ""),
        ]
        if self.steps is not None:
            parts.append(
                f"{self.steps} steps ({self.tokens_per_step:.2f} per step, "
                f"{self.from_draft} from the draft)"
            )
        parts += [
            f"first token after {self.first_token_seconds:.2f} s"
            + _rate_of(self.prefill_tokens_per_second, " (prefill {:.1f} tok/s)"),
            "decode " + ("-" if rate is None else f"{rate:.2f} tok/s"),
        ]
        if self.bytes_read_per_token is not None:
            parts.append(f"{format_bytes(self.bytes_read_per_token)} read per token")
        parts.append(f"peak RSS {format_bytes(self.peak_rss_bytes)}")
        if self.seed is not None:
            parts.append(f"seed {self.seed}")
        return "; ".join(parts)


def run_generate(args: argparse.Namespace) -> int:
    # everything the request can be checked for without a tokenizer, before models load
    options = GenerationOptions(
        max_new_tokens=args.max_new_tokens, sampling=sampling_of(args, seed_or_drawn(args.seed))
    )
    prompt, messages = _what_to_continue(args)
    if prompt is not None:
        check_prompt(len(prompt))
    if args.model is not None:
        if args.target or args.draft:
            raise ConfigError(
                "--model runs a model held in DRAM; --target/--draft run the pipeline"
            )
        summary = _generate_in_memory(args, prompt, messages, options)
    else:
        summary = _generate_with_engine(args, prompt, messages, options)
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


def _generate_in_memory(
    args: argparse.Namespace,
    prompt: str | None,
    messages: list[dict] | None,
    options: GenerationOptions,
) -> Summary:
    started = time.perf_counter()
    checkpoint = load_checkpoint(args.model, DTYPE_NAMES[args.dtype])
    tokenizer = checkpoint.tokenizer
    if tokenizer is None:
        raise ConfigError(f"{args.model} has no tokenizer; generate needs one to encode text")
    text = prompt if messages is None else tokenizer.apply_chat_template(messages)
    assert text is not None  # _what_to_continue gives a prompt or messages
    ids = tokenizer.encode(text)
    check_request_size(len(ids), options.max_new_tokens, checkpoint.args.max_seq_len)
    model = Transformer(checkpoint.args, checkpoint.weights)
    print(f"loaded {args.model.name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    printer = _TextPrinter(tokenizer, ids)
    started = first = time.perf_counter()
    tokens: list[int] = []
    stream = sequential_stream(
        model, ids, options.max_new_tokens, tokenizer.eos_ids, options.sampling
    )
    for token in stream:
        if not tokens:
            first = time.perf_counter()
        tokens.append(token)
        printer.push(token)
    printer.close()
    ended = finish_reason(
        end_token=bool(tokens) and tokens[-1] in tokenizer.eos_ids,
        generated=len(tokens),
        max_new_tokens=options.max_new_tokens,
    )
    return Summary(
        prompt_tokens=len(ids),
        generated_tokens=len(tokens),
        finish_reason=ended,
        first_token_seconds=first - started,
        prefill_tokens_per_second=decode_rate(len(ids), first - started),
        decode_tokens_per_second=decode_rate(len(tokens) - 1, time.perf_counter() - first),
        peak_rss_bytes=peak_rss_bytes(),
        seed=options.sampling.reported_seed,
    )


def _generate_with_engine(
    args: argparse.Namespace,
    prompt: str | None,
    messages: list[dict] | None,
    options: GenerationOptions,
) -> Summary:
    """The pipeline: the target streamed from flash, the draft in DRAM."""
    config = engine_config(args)
    return trio.run(_stream_from_engine, config, prompt, messages, options)


async def _stream_from_engine(
    config: EngineConfig,
    prompt: str | None,
    messages: list[dict] | None,
    options: GenerationOptions,
) -> Summary:
    started = time.perf_counter()
    async with Engine.open(config, progress=ProgressLine(unit="")) as engine:
        target, plan = engine.target, engine.target.plan
        if engine.tokenizer is None:
            raise ConfigError(f"{config.target} has no tokenizer; generate needs one")
        loaded = time.perf_counter() - started
        print(
            f"loaded in {loaded:.1f} s ({engine.load_times}); {engine.context}; "
            f"tree {engine.config.tree}, "
            f"{len(plan.streamed_layers)}/{target.args.n_layers} target layers streamed "
            f"({target.store.mode}), {format_bytes(plan.used(target.manifest))} of target "
            "weights in DRAM",
            file=sys.stderr,
        )
        print(engine.plan, file=sys.stderr)
        before = target.store.stats.bytes_read
        events: list[TokenEvent] = []
        prefill = ProgressLine(unit=" tokens")
        stream = engine.stream(prompt, messages=messages, options=options, progress=prefill)
        async for event in stream:
            events.append(event)
            sys.stdout.write(event.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        read = target.store.stats.bytes_read - before
    steps = len({e.step for e in events})
    last = events[-1]
    return Summary(
        prompt_tokens=last.prompt_tokens,
        generated_tokens=last.generated_tokens,
        finish_reason=last.finish_reason,
        first_token_seconds=events[0].elapsed_seconds,
        prefill_tokens_per_second=prefill_rate(events[0]),
        decode_tokens_per_second=decode_rate(*decode_phase(events)),
        peak_rss_bytes=peak_rss_bytes(),
        seed=options.sampling.reported_seed,
        steps=steps,
        tokens_per_step=per_step(len(events), steps),
        from_draft=sum(e.from_draft for e in events),
        bytes_read_per_token=read // len(events),
        load_seconds=loaded,
        cached_tokens=last.cached_tokens,
    )


def _rate_of(rate: float | None, template: str) -> str:
    return "" if rate is None else template.format(rate)


class _TextPrinter:
    """Writes each token's text to stdout as it comes, special tokens left out."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int]) -> None:
        self.decoder = tokenizer.stream_decoder(skip_special=True, context=prompt[-1:])

    def push(self, token: int) -> None:
        sys.stdout.write(self.decoder.push(token))
        sys.stdout.flush()

    def close(self) -> None:
        sys.stdout.write(self.decoder.flush() + "\n")
