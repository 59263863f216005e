"""What a request returns when run to the end (`Engine.generate`): its tokens, text,
per-token log-probabilities and per-step statistics, gathered from its events."""

from __future__ import annotations

import msgspec

from lever_actors.channels.messages import FinishReason, StepStats, TokenEvent, TopLogprob
from lever_actors.channels.stats import decode_phase, decode_rate, per_step, prefill_rate
from lever_actors.device.memory import peak_rss_bytes
from lever_actors.engine.state import RequestState


class GenerationResult(msgspec.Struct, frozen=True):
    tokens: list[int]  # the end token that stopped generation included
    text: str  # special tokens never appear in it, nor a stop string that ended it (keep_stop)
    logprobs: list[float]  # per token: the target's log-probability of it
    pieces: list[str]  # per token: its own text in context (stop strings aside)
    # per token, where the request asked (top_logprobs): its position's likeliest tokens
    top_logprobs: list[tuple[TopLogprob, ...]]
    steps: list[StepStats]
    finish_reason: FinishReason | None  # None only when no token was generated
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV an earlier request left (prefix cache)
    seed: int | None  # the sampling seed, given or drawn; None when greedy
    prefill_seconds: float  # request start to the first token
    prefill_tokens_per_second: float | None  # prompt tokens not cached, over prefill_seconds
    decode_tokens: int  # tokens after the first step, which comes with the prefill
    decode_seconds: float  # the end of the first step to the last token
    peak_rss_bytes: int  # this process's high-water mark of resident memory so far

    @property
    def generated_tokens(self) -> int:
        return len(self.tokens)

    @property
    def decode_tokens_per_second(self) -> float | None:
        return decode_rate(self.decode_tokens, self.decode_seconds)

    @property
    def mean_accepted(self) -> float | None:
        """New tokens per step (accepted draft tokens + the bonus token)."""
        return per_step(len(self.tokens), len(self.steps))


def result_of(request: RequestState, events: list[TokenEvent]) -> GenerationResult:
    """The result of a request that has ended, from all the events it emitted."""
    decode_tokens, decode_seconds = decode_phase(events)
    return GenerationResult(
        tokens=[e.token for e in events],
        text="".join(e.text for e in events),
        logprobs=[e.logprob for e in events],
        pieces=[e.piece for e in events],
        top_logprobs=[e.top_logprobs for e in events],
        steps=request.steps,
        finish_reason=events[-1].finish_reason if events else None,
        prompt_tokens=len(request.prompt),
        cached_tokens=request.reuse.tokens,
        seed=request.options.sampling.reported_seed,
        prefill_seconds=events[0].elapsed_seconds if events else 0.0,
        prefill_tokens_per_second=prefill_rate(events[0]) if events else None,
        decode_tokens=decode_tokens,
        decode_seconds=decode_seconds,
        peak_rss_bytes=peak_rss_bytes(),
    )
