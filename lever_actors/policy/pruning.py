"""Prune policies: which draft nodes the pruner drops, given their exit-layer states."""

from __future__ import annotations

from typing import Protocol

from lever_actors.channels.messages import ExitProbe
from lever_actors.policy.cost_model import CostModel


class PrunePolicy(Protocol):
    def __call__(self, probe: ExitProbe) -> tuple[int, ...]:
        """Blocking: the node indices to drop (their descendants go with them)."""
        ...


def keep_everything(probe: ExitProbe) -> tuple[int, ...]:
    return ()


class WhenComputeBound:
    """Prunes only when the cost model predicts that verification compute, not flash, sets
    the pace of this pass: pruning saves compute after the exit layer, which under I/O
    saves no time, while a false prune costs accepted tokens."""

    def __init__(self, policy: PrunePolicy, cost: CostModel) -> None:
        self.policy = policy
        self.cost = cost

    def __call__(self, probe: ExitProbe) -> tuple[int, ...]:
        if self.cost.io_bound(len(probe.tree.tokens)):
            return ()
        return self.policy(probe)
