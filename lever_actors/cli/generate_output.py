"""What `generate` writes as it goes: each token's text to stdout, and the figures to
stderr at the end (`Summary`), whichever path decoded."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import msgspec

from lever_actors.channels.messages import FinishReason
from lever_actors.channels.stats import decode_rate
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.device.memory import peak_rss_bytes
from lever_actors.options import GenerationOptions
from lever_actors.sizes import format_bytes
from lever_actors.text.finish import finish_reason


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
    from_draft: int | None = None  # proposed tokens taken: the draft's, or copies from the text
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
                f"{self.from_draft} proposed)"
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


def streamed(
    stream: Iterator[int], tokenizer: Tokenizer, prompt: list[int], options: GenerationOptions
) -> Summary:
    """Each token of `stream` (decoding after `prompt`) written to stdout as it comes, and
    their Summary, timed from this call: the first token's wait includes the prefill."""
    printer = TextPrinter(tokenizer, prompt)
    tokens: list[int] = []
    started = first = time.perf_counter()
    for token in stream:
        if not tokens:
            first = time.perf_counter()
        tokens.append(token)
        printer.push(token)
    printer.close()
    return _summary_of(len(prompt), tokens, tokenizer.eos_ids, options, started, first)


def _summary_of(
    prompt: int,
    tokens: list[int],
    eos_ids: frozenset[int],
    options: GenerationOptions,
    started: float,
    first: float,
) -> Summary:
    """The Summary of one request whose `tokens` came after a `prompt` of that many tokens,
    the first at `first` (perf_counter) after it started at `started`."""
    ended = finish_reason(
        end_token=bool(tokens) and tokens[-1] in eos_ids,
        generated=len(tokens),
        max_new_tokens=options.max_new_tokens,
    )
    return Summary(
        prompt_tokens=prompt,
        generated_tokens=len(tokens),
        finish_reason=ended,
        first_token_seconds=first - started,
        prefill_tokens_per_second=decode_rate(prompt, first - started),
        decode_tokens_per_second=decode_rate(len(tokens) - 1, time.perf_counter() - first),
        peak_rss_bytes=peak_rss_bytes(),
        seed=options.sampling.reported_seed,
    )


def _rate_of(rate: float | None, template: str) -> str:
    return "" if rate is None else template.format(rate)


class TextPrinter:
    """Writes each token's text to stdout as it comes, special tokens left out."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int]) -> None:
        self.decoder = tokenizer.stream_decoder(skip_special=True, context=prompt[-1:])

    def push(self, token: int) -> None:
        sys.stdout.write(self.decoder.push(token))
        sys.stdout.flush()

    def close(self) -> None:
        sys.stdout.write(self.decoder.flush() + "\n")
