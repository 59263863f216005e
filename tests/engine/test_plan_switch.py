"""A change of plan mid-request, from a draft's trees to copies of the text and back, keeps
every token the target's sequential one: a trial of copies forced at random steps
(`switch_at`), kept for good, kept beside the draft and then left, or ended, greedy and
seeded, alone and with requests after it, the draft let go and the target's layers grown
into the memory it held."""

from __future__ import annotations

from unittest import mock

import msgspec
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from lever_actors.config import EngineConfig
from lever_actors.device.budget import ResidencyPlan
from lever_actors.engine import Engine, switching
from lever_actors.model.sampling import GREEDY
from lever_actors.plan.switch import RECHECK_STEPS, TRIAL_STEPS, Prices
from lever_actors.testing import (
    assert_matches_sequential,
    engine_cases,
    reference_tokens,
    samplings,
    trees,
)
from lever_actors.testing.checkpoints import TINY_ARGS, budget_bytes, model_pair

gaincost = trees(kinds=("gaincost",))


def won(grows: bool) -> Prices:
    """A trial's prices where copies won; `grows`: the draft's memory would hold layers."""
    nowhere = ResidencyPlan(0, (), (), 0, 0, False)
    return Prices(trees=1.0, copies=2.0, grown=nowhere, grows=grows)


@settings(max_examples=max(1, settings.default.max_examples // 2))
@given(
    case=engine_cases(tree_shapes=gaincost, sampling=st.one_of(st.just(GREEDY), samplings())),
    switch_at=st.integers(1, 6),
    outcome=st.sampled_from(["lost", "for good", "beside the draft", "and back"]),
)
async def test_a_trial_of_copies_at_any_step_keeps_the_output_exact(case, switch_at, outcome):
    """Copies tried from step `switch_at` on, then kept for good (the draft let go), kept
    beside the draft (and left again for its trees after a check), or ended (the draft's
    trees again, its KV caught up with the text committed meanwhile)."""
    config = msgspec.structs.replace(case.engine_config(), switch_at=switch_at)
    prices = None if outcome == "lost" else won(grows=outcome == "for good")
    slower = outcome == "and back"  # the copies' pace at the check: below the trees'
    with (
        mock.patch.object(switching.PlanSwitch, "copies_win", lambda *_: prices),
        mock.patch.object(switching, "rate", lambda _: 0.0 if slower else 2.0),
    ):
        result = await assert_matches_sequential(
            config, case.prompt, case.max_new_tokens, sampling=case.sampling
        )
    decided = switch_at + TRIAL_STEPS
    assert all(s.draft_rounds == () for s in result.steps[switch_at:decided])
    copied = {"lost": decided, "and back": decided + RECHECK_STEPS}.get(outcome)
    after = result.steps[decided:] if copied is None else result.steps[copied:]
    assert all(bool(s.draft_rounds) == (copied is not None) for s in after)
    assert all(s.draft_rounds == () for s in result.steps[decided : copied or decided])


async def test_copies_kept_for_good_let_go_of_the_draft_for_every_later_request():
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(
        target=str(pair.target), draft=str(pair.draft), tree="gaincost", switch_at=2
    )
    prompt = [5, 6, 7, 8, 9] * 4
    async with Engine.open(config) as engine:
        assert engine.draft is not None
        with mock.patch.object(switching.PlanSwitch, "copies_win", lambda *_: won(grows=True)):
            first = await engine.generate(prompt, max_new_tokens=30)
        assert engine.draft is None and engine.switch.switched_at_step == 2 + TRIAL_STEPS
        assert all(s.draft_rounds == () for s in first.steps[2:])
        assert any(s.draft_rounds for s in first.steps[:2])
        results: list[list[int]] = []

        async def generate(p: list[int]) -> None:
            results.append((await engine.generate(p, max_new_tokens=12)).tokens)

        async with trio.open_nursery() as nursery:  # later requests copy from the start
            for p in (prompt, [3, 1, 4, 1, 5, 9, 2, 6]):
                nursery.start_soon(generate, p)
    assert first.tokens == reference_tokens(config.target, prompt, 30)
    expected = [reference_tokens(config.target, p, 12) for p in (prompt, [3, 1, 4, 1, 5, 9, 2, 6])]
    assert sorted(results) == sorted(expected)


async def test_copies_where_the_draft_would_hold_no_layer_keep_it_for_the_next_request(
    monkeypatch,
):
    """The target resident: copies that won their trial go on beside the draft, which the
    engine keeps, and the next request drafts again from its start."""
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(
        target=str(pair.target), draft=str(pair.draft), tree="gaincost", switch_at=2
    )
    monkeypatch.setattr(switching, "rate", lambda _: float("inf"))  # copies keep the pace
    prompt, other = [5, 6, 7, 8, 9] * 4, [3, 1, 4, 1, 5, 9, 2, 6]
    async with Engine.open(config) as engine:
        assert engine.target.plan.streamed_layers == ()
        first = await engine.generate(prompt, max_new_tokens=30)
        assert engine.draft is not None and not engine.switch.copying
        second = await engine.generate(other, max_new_tokens=12)
    assert all(s.draft_rounds == () for s in first.steps[2:])
    # the draft runs again before its trial (the prompt may go to the target alone first)
    assert any(s.draft_rounds for s in second.steps[: config.switch_at])
    assert first.tokens == reference_tokens(config.target, prompt, 30)
    assert second.tokens == reference_tokens(config.target, other, 12)


async def test_a_trial_that_loses_goes_back_to_the_trees():
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(
        target=str(pair.target), draft=str(pair.draft), tree="gaincost", switch_at=2
    )
    prompt = [5, 6, 7, 8, 9] * 4
    async with Engine.open(config) as engine:
        with mock.patch.object(switching.PlanSwitch, "copies_win", lambda *_: None):
            result = await engine.generate(prompt, max_new_tokens=40)
        assert engine.draft is not None and not engine.switch.copying
    after = result.steps[2 + TRIAL_STEPS :]
    assert after and all(s.draft_rounds for s in after)
    assert result.tokens == reference_tokens(config.target, prompt, 40)


async def test_the_memory_the_draft_gives_back_grows_the_target(monkeypatch):
    """Where letting go of the draft frees memory (here: the process reads as holding 1 GB
    less from the switch on), the target's streamed layers are read into DRAM, first ones
    first, and later passes use them; the output stays sequential greedy's."""
    pair = model_pair(msgspec.structs.replace(TINY_ARGS, n_layers=6), "perturbed", 0)
    config = EngineConfig(
        target=str(pair.target),
        draft=str(pair.draft),
        tree="gaincost",
        dram_budget=budget_bytes(pair.target, 0.0),
        switch_at=1,
    )
    held = iter([10**10] + [10**10 - 10**9] * 1000)  # at the switch, then after it
    monkeypatch.setattr(switching, "anonymous_rss_bytes", lambda: next(held))
    prompt = [5, 6, 7, 8, 9] * 4
    async with Engine.open(config) as engine:
        streamed = engine.target.plan.streamed_layers
        assert streamed
        engine.switch.draft_bytes = 10**9
        result = await engine.generate(prompt, max_new_tokens=30)
        assert engine.target.plan.streamed_layers == ()
        assert sorted(engine.target.resident_layers) == list(range(6))
        reads: list[str] = []
        read_extent = engine.target.store.read_extent

        def counting(extent, buffer, **options):
            reads.append(extent.key)
            return read_extent(extent, buffer, **options)

        monkeypatch.setattr(engine.target.store, "read_extent", counting)
        again = await engine.generate(prompt, max_new_tokens=30)
    assert result.tokens == again.tokens == reference_tokens(config.target, prompt, 30)
    assert reads == []  # no layer is read from flash any more
