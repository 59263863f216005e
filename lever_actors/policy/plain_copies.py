"""Copies from the text for the plain path (#63): after the text's end, the tokens that
followed it where it occurred before (policy/lookup.py), verified in the same pass as the
next token. They need no draft model, so no memory beside the whole target. A copy is taken
while the tokens a pass is expected to commit grow faster than its time: each copy is
accepted with the rate observed so far (given its parent was), and each row beyond the first
costs a share of a one-row pass, measured as the passes run. Where the text never repeats
itself nothing is copied and a pass is the one-token pass.

Decisions only; model/plain_model.py's token_stream runs the passes and reports them."""

from __future__ import annotations

from collections.abc import Sequence

from lever_actors.policy.lookup import LOOKUP_PRIOR, ContextIndex, copies_that_pay

CAP = 16  # most copies a pass verifies
# a row's time beside a one-row pass, before any pass is timed: two rows took 1.17x one,
# four 1.52x (the real target resident, 2-core EPYC, 2026-12-06)
ROW_COST_PRIOR = 0.17
PRIOR_WEIGHT = 4.0  # pseudo-observations behind each prior
# the weight of what was seen before each new observation: the text's habits drift
# (a list copies well, the prose after it does not)
KEEP = 0.97


class CopyProposer:
    """The copies to verify after the text, learning from each pass how they fare."""

    def __init__(self, cap: int = CAP) -> None:
        self.cap = cap
        self.index = ContextIndex()
        self.offered = self.accepted = 0.0  # copies that met the target, decayed
        self.one_row: float | None = None  # seconds of a one-row pass, a running mean
        self.row_cost = ROW_COST_PRIOR
        self.timed = 0.0  # weight of the row cost's observations
        self.committed: list[int] = []  # tokens each pass committed, its copies and its own

    def proposed(self, committed: Sequence[int]) -> list[int]:
        """The copies to verify after the text, extended first by the tokens `committed`
        since the last call (the prompt, then each pass's tokens)."""
        self.index.extend(committed)
        return copies_that_pay(
            self.index,
            self.acceptance(),
            self.cap,
            lambda n, tokens: tokens / (1 + self.row_cost * n),  # in one-row passes' time
        )

    @property
    def passes(self) -> int:
        return len(self.committed)

    @property
    def taken(self) -> int:
        """Copies the target took."""
        return sum(self.committed) - self.passes

    def acceptance(self) -> float:
        """The chance the target takes a copy whose parent it took."""
        return (self.accepted + PRIOR_WEIGHT * LOOKUP_PRIOR) / (self.offered + PRIOR_WEIGHT)

    def verified(self, rows: int, copies: int, taken: int, seconds: float) -> None:
        """A pass of `rows` rows verified `copies` copies in `seconds`, and the target took
        the first `taken` of them."""
        self.committed.append(taken + 1)
        met = taken + (taken < copies)  # the copies the target chose against: the taken, and
        self.offered = KEEP * self.offered + met  # the first it refused
        self.accepted = KEEP * self.accepted + taken
        if rows > copies + 1:  # the prompt's pass: its time is the prompt's
            return
        if copies == 0:
            self.one_row = seconds if self.one_row is None else (self.one_row + seconds) / 2
        elif self.one_row is not None:  # a row's share, against the one-row pass
            share = max(0.0, (seconds / self.one_row - 1) / copies)
            self.timed = KEEP * self.timed + 1
            weight = 1 / (self.timed + PRIOR_WEIGHT)
            self.row_cost += weight * (share - self.row_cost)
