"""Whether a step drafts at all: the gain-cost objective sizes a tree only after its first
draft round is paid, and where a draft round costs much against a pass of the target (the
target in DRAM: on the real pair a round of the 0.5B draft is about 40% of a 1.5B token),
the best tree earns less per second than one-token steps. This gate compares the two, each
as measured, and takes the faster, trying the other now and then: what a step earns moves
with the text (code is easier to draft than prose).

Drafted steps run first. One-token steps are tried where the cost model predicts them
within reach of what drafted steps measured, and again now and then only while they stay
within reach: where trees clearly pay (flash-bound passes) no step is spent proving it.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

ONLINE_WEIGHT = 0.3  # a moving average over the last few steps of each kind
RETRY_EVERY = 8  # steps of the faster kind between two of the slower
WITHIN_REACH = 0.8  # one-token steps at this share of the drafted rate are worth a try


class SpeculationGate(msgspec.Struct):
    """Tokens per second of drafted and of one-token steps (None: not yet measured), and the
    steps since each kind last ran."""

    drafted: float | None = None
    one_token: float | None = None
    since_drafted: int = 0
    since_one_token: int = 0

    def drafts(self, predicted_one_token: Callable[[], float]) -> bool:
        """Whether the next step drafts a tree; `predicted_one_token` gives the cost
        model's tokens per second for a one-token step, asked only if needed."""
        if self.drafted is None:
            return True
        if self.one_token is None:
            return predicted_one_token() < WITHIN_REACH * self.drafted
        if self.drafted >= self.one_token:  # one-token steps again only if within reach
            close = self.one_token >= WITHIN_REACH * self.drafted
            return not (close and self.since_one_token >= RETRY_EVERY)
        return self.since_drafted >= RETRY_EVERY

    def observe(self, drafted: bool, tokens: int, seconds: float) -> None:
        """One finished step: whether it drafted, the tokens it emitted, its time."""
        if seconds <= 0:
            return
        rate = tokens / seconds
        before = self.drafted if drafted else self.one_token
        now = rate if before is None else before + ONLINE_WEIGHT * (rate - before)
        if drafted:
            self.drafted, self.since_drafted = now, 0
            self.since_one_token += 1
        else:
            self.one_token, self.since_one_token = now, 0
            self.since_drafted += 1
