"""Figures derived from a request's token events, each defined here once."""

from __future__ import annotations

from collections.abc import Sequence

from lever_actors.channels.messages import TokenEvent


def decode_rate(tokens: int, seconds: float) -> float | None:
    """Tokens per second; None where nothing was measured."""
    return tokens / seconds if tokens > 0 and seconds > 0 else None


def prefill_rate(first: TokenEvent) -> float | None:
    """Prompt tokens prefilled (those not cached) per second, from a request's first event:
    the wait for the first token, which the prefill's pass gives."""
    return decode_rate(first.prompt_tokens - first.cached_tokens, first.elapsed_seconds)


def per_step(tokens: int, steps: int) -> float | None:
    """New tokens per target pass; None without a pass."""
    return tokens / steps if steps > 0 else None


class DecodePhase:
    """Running (tokens, seconds) of decoding proper: after the first step, which comes with
    the prefill, up to the latest token."""

    def __init__(self) -> None:
        self.first_step: int | None = None
        self.first_step_end = 0.0  # when the first step's last token came
        self.tokens = 0
        self.seconds = 0.0

    def add(self, step: int, elapsed_seconds: float) -> None:
        """One more token, of `step`, `elapsed_seconds` after the request started."""
        if self.first_step is None:
            self.first_step = step
        if step == self.first_step:
            self.first_step_end = elapsed_seconds
        else:
            self.tokens += 1
            self.seconds = elapsed_seconds - self.first_step_end

    @property
    def rate(self) -> float | None:
        return decode_rate(self.tokens, self.seconds)


def decode_phase(events: Sequence[TokenEvent]) -> tuple[int, float]:
    """(tokens, seconds) of decoding proper over a request's events (see DecodePhase)."""
    phase = DecodePhase()
    for event in events:
        phase.add(event.step, event.elapsed_seconds)
    return phase.tokens, phase.seconds
