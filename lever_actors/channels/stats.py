"""Figures derived from a request's token events, each defined here once."""

from __future__ import annotations

from collections.abc import Sequence

from lever_actors.channels.messages import TokenEvent


def decode_rate(tokens: int, seconds: float) -> float | None:
    """Tokens per second; None where nothing was measured."""
    return tokens / seconds if tokens > 0 and seconds > 0 else None


def per_step(tokens: int, steps: int) -> float | None:
    """New tokens per target pass; None without a pass."""
    return tokens / steps if steps > 0 else None


def decode_phase(events: Sequence[TokenEvent]) -> tuple[int, float]:
    """(tokens, seconds) of decoding proper: after the first step, which comes with the
    prefill, up to the last token."""
    if not events:
        return 0, 0.0
    first = [e for e in events if e.step == events[0].step]
    return len(events) - len(first), events[-1].elapsed_seconds - first[-1].elapsed_seconds
