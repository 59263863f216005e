"""Turns draft probabilities into estimated acceptance probabilities, learned online.

A draft node is "offered" when its parent was accepted (the target then decides it), and
"accepted" when the target's greedy token equals it. Offers are binned by the node's draft
probability and by whether it was its parent's first choice; each bin's rate starts from a
prior of the draft probability itself (the bin's middle). On the real pair a first choice
is accepted about as often as its probability says: drafted at 0.1-0.5, 11-56% of the time
(estimates from a prior of 0.5 + p/2 said 38-61%). Draft probabilities from SURE up get a bin
of their own: such first choices were accepted 138 times of 138, the rest of the top tenth
92% of the time, and one bin for both said 96% to either.

A node's children are exclusive (the target takes one token after it), so their
estimates, best first, are capped to sum to at most 1 (`ranked`). Nodes copied from the
text (rank LOOKUP_RANK, policy/lookup.py) have no draft probability; they learn a rate of
their own.
"""

from __future__ import annotations

import msgspec

from lever_actors.policy.lookup import LOOKUP_PRIOR, LOOKUP_RANK

BINS = 10  # equal bins of draft probability, the top one split at SURE
SURE = 0.99
EDGES = [i / BINS for i in range(BINS)] + [SURE, 1.0]  # each bin's lower edge, then 1
PER_RANK = len(EDGES) - 1  # bins for first choices, then as many for the rest
PRIOR_WEIGHT = 4.0  # pseudo-observations per bin before any evidence


class AcceptanceCalibrator(msgspec.Struct):
    offered: list[float] = msgspec.field(default_factory=lambda: [0.0] * 2 * PER_RANK)
    accepted: list[float] = msgspec.field(default_factory=lambda: [0.0] * 2 * PER_RANK)
    copies_offered: float = 0.0  # nodes copied from the text (policy/lookup.py)
    copies_accepted: float = 0.0

    def acceptance(self, draft_prob: float, rank: int) -> float:
        """Estimated probability that the target accepts a candidate, given its parent was."""
        b = _bin(draft_prob, rank)
        prior = (EDGES[b % PER_RANK] + EDGES[b % PER_RANK + 1]) / 2
        return (self.accepted[b] + PRIOR_WEIGHT * prior) / (self.offered[b] + PRIOR_WEIGHT)

    def copy_acceptance(self) -> float:
        """Estimated probability that the target accepts a token copied from the text,
        given its parent was accepted."""
        weighted = self.copies_accepted + PRIOR_WEIGHT * LOOKUP_PRIOR
        return weighted / (self.copies_offered + PRIOR_WEIGHT)

    def first_choice_rate(self) -> float:
        """How often the target took a node's first-ranked draft, over all offered so far
        (SURE before any): what a round may expect of the best child it will draft."""
        offered, accepted = sum(self.offered[:PER_RANK]), sum(self.accepted[:PER_RANK])
        return (accepted + PRIOR_WEIGHT * SURE) / (offered + PRIOR_WEIGHT)

    def ranked(self, probs: list[float]) -> list[float]:
        """A node's children's estimates, given their draft probabilities best first: each
        at most what its better siblings leave of 1."""
        out, left = [], 1.0
        for rank, prob in enumerate(probs):
            estimate = min(self.acceptance(prob, rank), left)
            out.append(estimate)
            left -= estimate
        return out

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
            if parents[node] not in on_path:
                continue
            if ranks[node] == LOOKUP_RANK:
                self.copies_offered += 1
                self.copies_accepted += node in on_path
                continue
            b = _bin(probs[node], ranks[node])
            self.offered[b] += 1
            self.accepted[b] += node in on_path


def _bin(p: float, rank: int) -> int:
    within = BINS if p >= SURE else min(int(p * BINS), BINS - 1)
    return within + (PER_RANK if rank > 0 else 0)
