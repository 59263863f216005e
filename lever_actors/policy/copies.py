"""A tree without a draft model: the chain of tokens that followed the text's end where it
occurred before (policy/lookup.py), one copy after another for as long as the gain-cost
objective pays for each. It holds no draft weights, so under a memory limit the target
keeps more of its own in DRAM; it costs no draft forward, so a compute-bound pass pays only
for the rows it verifies."""

from __future__ import annotations

from lever_actors.channels.messages import ALONE, Beside
from lever_actors.policy.calibration import AcceptanceCalibrator
from lever_actors.policy.cost_model import CostModel
from lever_actors.policy.lookup import ContextIndex


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
    rate = calibrator.copy_acceptance()
    copies: list[int] = []
    reach, expected = 1.0, 0.0  # the chance every copy so far is accepted; their sum
    best = cost.pass_rate(n_chain, [], 1, beside)  # the bonus token always comes
    while len(copies) < cap:
        token = context.follower(copies)
        if token is None:
            break
        gain = reach * rate
        tokens = 1 + expected + gain
        score = cost.pass_rate(n_chain + len(copies) + 1, [], tokens, beside)
        if score <= best:
            break
        copies.append(token)
        reach, expected, best = gain, expected + gain, score
    return copies
