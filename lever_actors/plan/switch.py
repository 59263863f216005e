"""Whether a request's text says to stop drafting. The plan chosen at start prices trees by
shapes measured on code, where a draft's trees accept five tokens a step; on prose they
accept about two, and the draft's DRAM, given to the target's layers instead, may pay more.
So after a few steps of trees, copies of the text (plan lookup) are priced against them.
Where the draft's memory would hold layers the target streams, copies priced far faster are
kept for good at once: the draft is let go of and the target's layers grown into its
memory. Otherwise a request tries them for a few steps with the draft still loaded, and
copies that then beat the trees it ran (with the flash time the draft's memory would save
taken off) are kept: for good where that memory holds layers, else with the draft kept and
the copies' pace checked every few steps against the trees', back to trees once slower.
A draft let go is not loaded again.

Decisions only; the engine carries them out (engine/switching.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from lever_actors.channels.messages import StepStats
from lever_actors.device.budget import ResidencyPlan, grown_residency
from lever_actors.device.manifest import Manifest
from lever_actors.policy.cost_model import CostModel
from lever_actors.policy.lookup import CopySteps, copy_steps

FIRST_LOOK = 4  # steps of trees decoded before copies may be tried
TRIAL_STEPS = 4  # steps of copies tried
# copies are tried where the cost model prices them at this share of the trees' rate or
# more. Its price errs both ways, by up to a third (2-core EPYC, everything resident:
# prose priced 36 tok/s beside trees at 41 ran at 39-45; code priced 63-64 beside trees at
# 54 ran at 38-40), and a trial that loses costs a short answer 5-10%: so only where copies
# are priced at least as fast (the case that pays, trees at 1.5 GiB on prose beside seven
# streamed layers the draft's memory would hold, is priced far above)
TRIAL_BAR = 1.0
# copies priced this much faster than the trees are kept without a trial (priced within a
# third, they cannot then be slower), where the draft's memory would hold streamed layers: a
# trial of copies that stream them is slow, and it delays the layers' reads. Where it would
# hold none (the target resident), nothing is lost by trying first.
SURE = 1.5
# copies tried must beat the trees by this much to be kept: the draft is not loaded again,
# and a text's next part may suit trees better than its start
MARGIN = 1.15
# copies kept beside the draft are checked against the trees' pace every this many steps
RECHECK_STEPS = 8
TEXT_WINDOW = 2048  # the text's last tokens the copies may come from
COUNTED = 512  # of those, the last ones whose copies are counted (half the window at most)


class Prices(msgspec.Struct, frozen=True):
    """Tokens per second of a request's trees as they ran, and of copies."""

    trees: float
    copies: float  # predicted before a trial; after it, as it ran, less the flash time saved
    grown: ResidencyPlan  # the target's residency with the draft's memory given to it
    grows: bool  # whether that memory would hold layers the target streams now

    @property
    def worth_a_trial(self) -> bool:
        return self.copies >= TRIAL_BAR * self.trees

    @property
    def copies_sure(self) -> bool:
        return self.grows and self.copies > SURE * self.trees

    @property
    def copies_win(self) -> bool:
        return self.copies > MARGIN * self.trees

    def __str__(self) -> str:
        return (
            f"trees {self.trees:.1f} tok/s, copies {self.copies:.1f} tok/s with "
            f"{len(self.grown.streamed_layers)} layers streamed"
        )


def prompt_steps(steps: Sequence[StepStats]) -> int:
    """A request's first steps that carry its prompt, not its trees' pace: the first (the
    target's prefill) and, where that one went without the draft (the prompt alone,
    actors/drafter.py), the second, whose first draft forward runs the prompt."""
    return 2 if steps and not steps[0].draft_rounds else 1


def due(steps: Sequence[StepStats]) -> bool:
    """Whether copies may be tried after these steps of trees: once FIRST_LOOK steps have
    decoded after those that carry the prompt."""
    return len(steps) == FIRST_LOOK + prompt_steps(steps)


def rate(steps: Sequence[StepStats]) -> float:
    """Tokens per second of `steps` as they ran."""
    seconds = sum(step.step_seconds for step in steps)
    return sum(step.new_tokens for step in steps) / seconds if seconds > 0 else 0.0


def _trees_rate(steps: Sequence[StepStats]) -> float:
    return rate(steps[prompt_steps(steps) :])


def _grown(
    cost: CostModel, manifest: Manifest, residency: ResidencyPlan, draft_bytes: int
) -> tuple[ResidencyPlan, CostModel]:
    grown = grown_residency(manifest, residency, draft_bytes)
    streamed = sum(manifest.layer(i).nbytes for i in grown.streamed_layers)
    return grown, msgspec.structs.replace(cost, streamed_bytes=streamed)


def _grows(grown: ResidencyPlan, residency: ResidencyPlan) -> bool:
    return grown.streamed_layers != residency.streamed_layers


def copies_on(text: Sequence[int], cap: int) -> CopySteps:
    """Tokens a step of copies (up to `cap`) commits on the text's recent part, and nodes it
    verifies, counted on the text itself."""
    window = text[-TEXT_WINDOW:]
    counted = min(COUNTED, len(window) // 2)
    return copy_steps(window, len(window) - counted, cap)


def predicted(
    cost: CostModel,
    steps: Sequence[StepStats],
    text: Sequence[int],
    manifest: Manifest,
    residency: ResidencyPlan,
    draft_bytes: int,
    cap: int,
) -> Prices:
    """The trees `steps` grew, as they ran, against copies of `text` (up to `cap` a step)
    under `residency` grown by `draft_bytes`: each step as measured, less its drafting,
    scaled by what `cost` prices a pass of copies at against its pass. A ratio, so an error
    in the cost model's level (its profile measured on a busier or quieter machine) cancels;
    a difference let an overpriced tree price copies up to twice as fast as they ran."""
    tokens, nodes = copies_on(text, cap)
    grown, copying = _grown(cost, manifest, residency, draft_bytes)
    copy_pass = copying.step_seconds(nodes, [], tokens)
    decoded = steps[prompt_steps(steps) :]
    copy_seconds = sum(
        (step.step_seconds - step.draft_seconds)
        * copy_pass
        / cost.step_seconds(step.tree_nodes, [], step.new_tokens)
        for step in decoded
    )
    trees = _trees_rate(steps)
    copies = tokens * len(decoded) / copy_seconds if copy_seconds > 0 else trees
    return Prices(trees, copies, grown, _grows(grown, residency))


def tried(
    cost: CostModel,
    trees: Sequence[StepStats],
    copies: Sequence[StepStats],
    text: Sequence[int],
    manifest: Manifest,
    residency: ResidencyPlan,
    draft_bytes: int,
    cap: int,
) -> Prices:
    """The trees that ran against the copies tried after them: each step of copies less the
    flash time `cost` prices the layers `draft_bytes` would hold at, and no more tokens a
    step than copies commit on the recent `text` (a few steps may fall on a passage that
    repeats an earlier one)."""
    grown, copying = _grown(cost, manifest, residency, draft_bytes)
    seconds = sum(
        step.step_seconds
        - cost.step_seconds(step.tree_nodes, [], step.new_tokens)
        + copying.step_seconds(step.tree_nodes, [], step.new_tokens)
        for step in copies
    )
    tokens = min(sum(step.new_tokens for step in copies), copies_on(text, cap).tokens * len(copies))
    copies_rate = tokens / seconds if seconds > 0 else math.inf
    return Prices(_trees_rate(trees), copies_rate, grown, _grows(grown, residency))
