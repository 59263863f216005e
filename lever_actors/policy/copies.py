"""A tree without a draft model: the chain of tokens that followed the text's end where it
occurred before (policy/lookup.py), one copy after another for as long as the gain-cost
objective pays for each. It holds no draft weights, so under a memory limit the target
keeps more of its own in DRAM; it costs no draft forward, so a compute-bound pass pays only
for the rows it verifies."""

from __future__ import annotations

from lever_actors.channels.messages import ALONE, Beside
from lever_actors.policy.calibration import AcceptanceCalibrator
from lever_actors.policy.cost_model import CostModel
from lever_actors.policy.lookup import ContextIndex, copies_that_pay


def copied_chain(
    context: ContextIndex,
    n_chain: int,
    cost: CostModel,
    calibrator: AcceptanceCalibrator,
    cap: int,
    beside: Beside = ALONE,
) -> list[int]:
    """The copies to verify below the committed chain of `n_chain` tokens (the text's end):
    each is taken while expected tokens per predicted second of the pass (with the requests
    `beside` it) improve."""
    return copies_that_pay(
        context,
        calibrator.copy_acceptance(),
        cap,
        lambda n, tokens: cost.pass_rate(n_chain + n, [], tokens, beside, n_chain),
    )
