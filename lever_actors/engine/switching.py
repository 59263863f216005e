"""The engine's change of plan from a draft's trees to copies of the text, as plan/switch.py
decides it. A request tries copies for a few steps, its drafter told in its commits, then
goes back to its trees or keeps the copies. Kept where the draft's memory would hold
streamed layers, they are kept for good: every request's drafter is told in its next commit
and lets go of the draft model, the engine lets go of its reference, and once the memory is
back, measured, the target's next streamed layers are read into DRAM on a worker thread
beside decoding, resident from the next pass on. Kept where it would hold none, the draft
stays, and the request goes back to its trees once its copies run slower than they did.
Any tree gives the target's own tokens, so the output is the same whichever plan a step
ran under."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import trio

from lever_actors.channels.messages import StepStats, Then
from lever_actors.config import EngineConfig, TreeSpec
from lever_actors.device.budget import grown_residency
from lever_actors.device.memory import anonymous_rss_bytes, return_freed_heap
from lever_actors.model.transformer import Transformer
from lever_actors.plan.start import StartPlan
from lever_actors.plan.switch import RECHECK_STEPS, TRIAL_STEPS, Prices, due, predicted, rate, tried
from lever_actors.policy.setup import Policies
from lever_actors.target import FlashTarget

log = logging.getLogger(__name__)

GROWTH_CHECKS = 8  # steps after the switch whose freed memory may still grow the target


class PlanSwitch:
    """Whether the engine still drafts, the one trial of copies running at a time, and the
    change to copies for good."""

    def __init__(
        self,
        config: EngineConfig,
        plan: StartPlan,
        target: FlashTarget,
        policies: Policies,
        draft: Transformer | None,
        nursery: trio.Nursery,
    ) -> None:
        self.draft = draft  # None once let go (or never loaded)
        # from this many requests decoding together, each step of theirs copies the text
        self.copies_from = plan.decode.copies_from
        self.forced_at = config.switch_at
        # only a plan auto chose may change, and only gain-cost trees have the prices
        self.allowed = policies.spec.kind == "gaincost" and (
            self.forced_at is not None or plan.decode.auto
        )
        self.target, self.policies, self._nursery = target, policies, nursery
        self.draft_bytes = plan.memory.draft  # what letting go of the draft may give back
        self.prices: Prices | None = None  # the last comparison
        self.switched_at_step: int | None = None  # of the request whose trial decided
        self.trying = False  # a request is trying copies
        self._held_before = 0  # anonymous memory when the draft was let go
        self._grown = 0  # bytes of layers made resident since
        self._checks = 0
        self._growing = False

    @property
    def copying(self) -> bool:
        """Whether the engine has let go of its draft for copies of the text."""
        return self.switched_at_step is not None

    def follower(self, drafting: bool) -> RequestPlan:
        """A request's view of the plan: `drafting`, its drafter proposes with the draft."""
        return RequestPlan(self, "trees" if drafting else "copies")

    def after_any_step(self) -> None:
        """After any request's step: grow the target by the memory the draft gave back so far."""
        if not self.copying or self._growing or self._checks >= GROWTH_CHECKS:
            return
        self._checks += 1
        return_freed_heap()
        # what is free of what the process held with the draft (grown layers hold some)
        freed = min(self.draft_bytes - self._grown, self._held_before - anonymous_rss_bytes())
        plan = grown_residency(self.target.manifest, self.target.plan, max(freed, 0))
        if plan.streamed_layers != self.target.plan.streamed_layers:
            self._growing = True
            self._nursery.start_soon(self._grow, plan.budget - self.target.plan.budget)

    def priced(
        self, steps: Sequence[StepStats], prompt: Sequence[int], tokens: Sequence[int]
    ) -> Prices | None:
        """Copies priced against a request's trees, where it is time to; else None."""
        cost = self.policies.cost
        if self.trying or cost is None or not due(steps):
            return None
        self.prices = predicted(
            cost,
            steps,
            [*prompt, *tokens],
            self.target.manifest,
            self.target.plan,
            self.draft_bytes,
            self.policies.spec.cap,
        )
        log.info("plan: copies priced (%s)", self.prices)
        return self.prices

    def copies_win(
        self, trees: Sequence[StepStats], copies: Sequence[StepStats], text: Sequence[int]
    ) -> Prices | None:
        """The trial's prices where its copies won, else None."""
        cost = self.policies.cost
        assert cost is not None  # gain-cost trees ran
        self.prices = tried(
            cost,
            trees,
            copies,
            text,
            self.target.manifest,
            self.target.plan,
            self.draft_bytes,
            self.policies.spec.cap,
        )
        log.info("plan: tried copies (%s)", self.prices)
        return self.prices if self.forced_at is not None or self.prices.copies_win else None

    def switch(self, step: int) -> None:
        log.info("plan: copies from now on, after %d steps", step)
        self.switched_at_step = step
        self.policies.spec = TreeSpec("lookup", cap=self.policies.spec.cap)
        self.draft = None  # the drafters hold the rest, until their next commits
        self._held_before = anonymous_rss_bytes()

    async def _grow(self, extra: int) -> None:
        """Read the layers `extra` bytes hold into DRAM, then pass them resident."""
        try:
            target = self.target
            plan = grown_residency(target.manifest, target.plan, extra)
            await trio.to_thread.run_sync(target.hold, plan)
            self._grown += extra
            if self.policies.cost is not None:
                self.policies.cost.streamed_bytes = sum(
                    target.manifest.layer(i).nbytes for i in plan.streamed_layers
                )
            log.info("plan: %d layers streamed now", len(plan.streamed_layers))
        finally:
            self._growing = False


class RequestPlan:
    """How one request's drafter proposes, step after step: the draft's trees, a trial of
    copies (at most one), copies beside the draft kept (checked against the trees' pace),
    or copies for good."""

    def __init__(self, switch: PlanSwitch, state: Literal["trees", "copies"]) -> None:
        self.switch = switch
        self.state: Literal["trees", "trying", "copying", "copies"] = state
        self.tried = False
        self.trial_from = 0  # the first step of the trial
        self.checked_from = 0  # copying: the first step since the last check
        self.trees_rate = 0.0  # copying: the trees' tokens per second, as they ran

    def after_step(
        self, steps: Sequence[StepStats], prompt: Sequence[int], tokens: Sequence[int]
    ) -> Then:
        """After the request's step: how its drafter proposes from the next one on."""
        switch = self.switch
        if self.state == "copies":
            return "same"
        if switch.copying:  # another request's trial decided
            return self._end("copies")
        if self.state == "copying":
            return self._check(steps)
        if self.state == "trying":
            if len(steps) - self.trial_from < TRIAL_STEPS:
                return "same"
            trees, copies = steps[: self.trial_from], steps[self.trial_from :]
            switch.trying = False
            won = switch.copies_win(trees, copies, [*prompt, *tokens])
            if won is None:
                return self._end("trees")
            if won.grows:
                switch.switch(len(steps))
                return self._end("copies")
            # the draft's memory would hold no layer: keep it, to go back to its trees
            self.state, self.checked_from, self.trees_rate = "copying", len(steps), won.trees
            return "same"
        if not switch.allowed or self.tried:
            return "same"
        if switch.forced_at is not None:  # testing: a trial from that step on
            if len(steps) < switch.forced_at:
                return "same"
        else:
            prices = switch.priced(steps, prompt, tokens)
            if prices is None or not prices.worth_a_trial:
                return "same"
            if prices.copies_sure:
                switch.switch(len(steps))
                return self._end("copies")
        self.state, self.tried, self.trial_from = "trying", True, len(steps)
        switch.trying = True
        return "try_copies"

    def _check(self, steps: Sequence[StepStats]) -> Then:
        """Copies beside the kept draft, every RECHECK_STEPS steps: on while they run at
        the trees' pace or faster, else back to the trees (no trial again: no flapping)."""
        if len(steps) - self.checked_from < RECHECK_STEPS:
            return "same"
        recent = rate(steps[self.checked_from :])
        self.checked_from = len(steps)
        if recent >= self.trees_rate:
            return "same"
        log.info("plan: trees again (copies ran %.1f tok/s, trees %.1f)", recent, self.trees_rate)
        return self._end("trees")

    def _end(self, then: Literal["trees", "copies"]) -> Then:
        self.state = then
        return then
