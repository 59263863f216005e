"""Prune policies: which draft nodes the pruner drops, given their exit-layer states."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from lever_actors.channels.messages import ExitProbe
from lever_actors.policy.cost_model import CostModel


class PrunePolicy(Protocol):
    def __call__(self, probe: ExitProbe) -> tuple[int, ...]:
        """Blocking: the node indices to drop (their descendants go with them)."""
        ...


def keep_everything(probe: ExitProbe) -> tuple[int, ...]:
    return ()


# tree nodes -> whether the verifier stops at the exit layer for the pruner's verdict
ProbeWhen = Callable[[int], bool]


def always(nodes: int) -> bool:
    return True


def when_compute_bound(cost: CostModel, share_after_exit: float) -> ProbeWhen:
    """Probe only where the cost model predicts that verification compute, not flash, sets
    the pace of the pass, and that pruning the `share_after_exit` of its layers after the
    exit layer can save more than the probe costs: pruning saves compute after the exit
    layer, which under I/O saves no time, while a false prune costs accepted tokens, and a
    small resident tree has little to save (probing trees of 2-4 nodes, memory-resident,
    ran 2% slower). The verifier asks before it probes, so an I/O-bound pass never waits
    for the pruner's unit (busy drafting ahead)."""
    return lambda nodes: not cost.io_bound(nodes) and cost.pruning_pays(nodes, share_after_exit)
