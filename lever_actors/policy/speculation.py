"""Whether a step drafts at all: the gain-cost objective sizes a tree only after its first
draft round is paid, and where a draft round costs much against a pass of the target (the
target in DRAM: on the real pair a round of the 0.5B draft is about 40% of a 1.5B token),
the best tree earns less per second than one-token steps. This gate compares the two, each
as measured, and takes the faster, trying the other now and then: what a step earns moves
with the text (code is easier to draft than prose).

Drafted steps run first. One-token steps are tried where the cost model predicts them
within reach of what drafted steps measured, and again now and then only while they stay
within reach: where trees clearly pay (flash-bound passes) no step is spent proving it.
Each retry that finds its kind still the slower doubles the wait before the next.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

ONLINE_WEIGHT = 0.3  # a moving average over the last few steps of each kind
RETRY_EVERY = 8  # steps of the faster kind before the slower runs again, at first
MOST_BETWEEN_RETRIES = 64  # each retry that stays slower doubles the wait, up to this
WITHIN_REACH = 0.8  # one-token steps at this share of the drafted rate are worth a try


class SpeculationGate(msgspec.Struct):
    """Tokens per second of drafted and of one-token steps (None: not yet measured), and the
    steps since each kind last ran."""

    drafted: float | None = None
    one_token: float | None = None
    since_drafted: int = 0
    since_one_token: int = 0
    retry_after: int = RETRY_EVERY  # steps of the faster kind before the slower runs again

    def drafts(self, predicted_one_token: Callable[[], float]) -> bool:
        """Whether the next step drafts a tree; `predicted_one_token` gives the cost
        model's tokens per second for a one-token step, asked only if needed."""
        if self.drafted is None:
            return True
        if self.one_token is None:
            return predicted_one_token() < WITHIN_REACH * self.drafted
        if self.drafted >= self.one_token:  # one-token steps again only if within reach
            close = self.one_token >= WITHIN_REACH * self.drafted
            return not (close and self.since_one_token >= self.retry_after)
        return self.since_drafted >= self.retry_after

    def observe(self, drafted: bool, tokens: int, seconds: float) -> None:
        """One finished step: whether it drafted, the tokens it emitted, its time."""
        if seconds <= 0:
            return
        faster_before = self._drafting_faster()
        rate = tokens / seconds
        before = self.drafted if drafted else self.one_token
        now = rate if before is None else before + ONLINE_WEIGHT * (rate - before)
        if drafted:
            self.drafted, self.since_drafted = now, 0
            self.since_one_token += 1
        else:
            self.one_token, self.since_one_token = now, 0
            self.since_drafted += 1
        if faster_before is not None and drafted != faster_before:  # the slower kind retried
            still = self._drafting_faster() == faster_before
            self.retry_after = (
                min(2 * self.retry_after, MOST_BETWEEN_RETRIES) if still else RETRY_EVERY
            )

    def _drafting_faster(self) -> bool | None:
        """Whether drafted steps are the faster kind; None until both are measured."""
        if self.drafted is None or self.one_token is None:
            return None
        return self.drafted >= self.one_token
