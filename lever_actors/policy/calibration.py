"""Turns draft probabilities into estimated acceptance probabilities, learned online.

A draft node is "offered" when its parent was accepted (the target then decides it), and
"accepted" when the target's greedy token equals it. Offers are binned by the node's draft
probability and by whether it was its parent's first choice (with flat draft distributions
the first choice is accepted far more often than its probability says); each bin's rate
starts from a prior of the draft probability itself.
"""

from __future__ import annotations

import msgspec

BINS = 10
PRIOR_WEIGHT = 4.0  # pseudo-observations per bin before any evidence


class AcceptanceCalibrator(msgspec.Struct):
    offered: list[float] = msgspec.field(default_factory=lambda: [0.0] * 2 * BINS)
    accepted: list[float] = msgspec.field(default_factory=lambda: [0.0] * 2 * BINS)

    def acceptance(self, draft_prob: float, rank: int) -> float:
        """Estimated probability that the target accepts a candidate, given its parent was."""
        b = _bin(draft_prob, rank)
        prior = (b % BINS + 0.5) / BINS
        if rank == 0:  # a draft's first choice is right more often than its probability says
            prior = 0.5 + 0.5 * prior
        return (self.accepted[b] + PRIOR_WEIGHT * prior) / (self.offered[b] + PRIOR_WEIGHT)

    def observe(
        self,
        parents: tuple[int, ...],
        probs: tuple[float, ...],
        ranks: tuple[int, ...],
        n_committed: int,
        accepted: tuple[int, ...],
    ) -> None:
        """One verified tree: which draft nodes were offered to the target and which it took."""
        on_path = set(accepted)
        for node in range(n_committed, len(parents)):
            if parents[node] in on_path:
                b = _bin(probs[node], ranks[node])
                self.offered[b] += 1
                self.accepted[b] += node in on_path


def _bin(p: float, rank: int) -> int:
    return min(int(p * BINS), BINS - 1) + (BINS if rank > 0 else 0)
