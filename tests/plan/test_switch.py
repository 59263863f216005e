"""The plan's switch from trees to copies, priced: copies read off the text itself, the
trees a request has grown, and the target's residency grown by the draft's memory."""

from __future__ import annotations

import msgspec
import pytest

from lever_actors.channels.messages import StepStats
from lever_actors.device.budget import minimum_budget, plan_residency
from lever_actors.device.manifest import read_manifest
from lever_actors.plan.switch import MARGIN, SURE, TRIAL_BAR, due, predicted, tried
from lever_actors.policy.cost_model import CostModel, Curve
from lever_actors.policy.lookup import CopySteps, copy_steps
from lever_actors.testing.checkpoints import TINY_ARGS, flash_layout, tiny_checkpoint


def test_copies_count_the_runs_a_repeating_text_would_have_given():
    assert copy_steps([1, 2, 3, 4, 5, 6, 7, 8], 0, 8) == CopySteps(1.0, 1.0)  # no repeats
    # the text repeats itself from token 10 on: once its end matches three earlier tokens,
    # a step takes the whole run of copies that follows, up to the cap
    text = list(range(10)) * 2
    assert copy_steps(text, 13, 16) == CopySteps(7.0, 8.0)  # one step: the last 7 tokens
    assert copy_steps(text, 13, 4) == CopySteps(7 / 2, 8 / 2)  # four copies and its own, then 2
    assert copy_steps(text, 10, 16) == CopySteps(10 / 4, 11 / 4)  # 3 of one before matching
    assert copy_steps([], 0, 4) == CopySteps(1.0, 1.0)
    # a copy found that the text does not follow is verified too: a node, no token
    assert copy_steps([1, 2, 3, 4, 1, 2, 3, 5], 7, 4) == CopySteps(1.0, 2.0)


def test_copies_may_be_tried_once_four_steps_have_decoded_after_the_prompts_steps():
    steps = _steps(_cost(0), tokens=2, nodes=3, rounds=(2, 1)) * 2  # the first ran the prompt
    assert [n for n in range(1, 10) if due(steps[:n])] == [5]
    # the prompt went alone (no draft forward): the second step ran it in the draft
    alone = [msgspec.structs.replace(steps[0], draft_rounds=()), *steps[1:]]
    assert [n for n in range(1, 10) if due(alone[:n])] == [6]


def test_the_trees_pace_leaves_out_the_step_that_ran_a_prompt_gone_alone_in_the_draft():
    manifest, residency, layer, cost = _case()
    steps = _steps(cost, tokens=2, nodes=15, rounds=(4, 4, 4, 3))
    steps.append(steps[1])  # four steps of trees after the two that carry the prompt
    prose = list(range(200))
    alone = [
        msgspec.structs.replace(steps[0], draft_rounds=()),
        msgspec.structs.replace(steps[1], step_seconds=50 * steps[1].step_seconds),
        *steps[2:],
    ]
    prices = predicted(cost, alone, prose, manifest, residency, draft_bytes=10 * layer, cap=16)
    assert prices.trees == pytest.approx(2 / steps[2].step_seconds)


def _cost(streamed: int) -> CostModel:
    return CostModel(
        flash_bandwidth=1e9,
        streamed_bytes=streamed,
        verify=Curve([1, 16], [0.01, 0.04]),
        draft=Curve([1, 16], [0.005, 0.01]),
        project_seconds=0.001,
        head_pass_seconds=0.0,
    )


def _steps(cost: CostModel, tokens: int, nodes: int, rounds: tuple[int, ...]) -> list[StepStats]:
    """Steps of trees that took what `cost` prices them at; the first one carries a prefill."""
    seconds = cost.step_seconds(nodes, list(rounds), tokens)
    return [
        StepStats(
            step=i,
            tree_nodes=nodes,
            live_nodes=nodes,
            pruned=0,
            saved_node_layers=0,
            probe_seconds=0.0,
            audited=False,
            false_prunes=0,
            projected_nodes=tokens,
            drafted_ahead=0,
            draft_rounds=rounds,
            draft_seconds=sum(cost.draft(r) for r in rounds),
            io_wait_seconds=0.0,
            verify_seconds=0.0,
            project_seconds=0.0,
            new_tokens=tokens,
            step_seconds=seconds * (100 if i == 0 else 1),
        )
        for i in range(5)
    ]


def _case(n_layers: int = 6):
    layout = flash_layout(tiny_checkpoint(msgspec.structs.replace(TINY_ARGS, n_layers=n_layers)))
    manifest = read_manifest(layout)
    residency = plan_residency(manifest, minimum_budget(manifest))  # every layer streams
    layer = manifest.layer(0).nbytes
    # bandwidth so low that each streamed layer costs 0.1 s: flash paces the pass
    streamed = len(residency.streamed_layers) * layer
    cost = msgspec.structs.replace(_cost(streamed), flash_bandwidth=layer / 0.1)
    return manifest, residency, layer, cost


def test_copies_are_tried_where_the_draft_memory_would_hold_the_layers_the_trees_stream():
    manifest, residency, layer, cost = _case()
    prose = list(range(200))  # never repeats: copies give one token a step
    poor = _steps(cost, tokens=2, nodes=15, rounds=(4, 4, 4, 3))
    prices = predicted(cost, poor, prose, manifest, residency, draft_bytes=10 * layer, cap=16)
    assert prices.grown.streamed_layers == ()  # the draft's memory holds them all
    assert prices.trees == 2 / poor[1].step_seconds  # as they ran, the prefill's step left out
    assert prices.worth_a_trial
    # no memory to grow into: copies would stream every layer, for one token a step
    assert not predicted(cost, poor, prose, manifest, residency, 0, 16).worth_a_trial
    # trees that accept six tokens a step are not worth a trial where the draft's memory
    # holds a third of the layers
    rich = _steps(cost, tokens=6, nodes=15, rounds=(4, 4, 4, 3))
    assert not predicted(cost, rich, prose, manifest, residency, 2 * layer, 16).worth_a_trial


def test_copies_tried_are_kept_where_they_ran_faster_with_the_flash_time_saved():
    manifest, residency, layer, cost = _case()
    trees = _steps(cost, tokens=2, nodes=15, rounds=(4, 4, 4, 3))
    copies = _steps(cost, tokens=1, nodes=2, rounds=())[1:]  # they streamed every layer
    prose = list(range(200))
    kept = tried(cost, trees, copies, prose, manifest, residency, draft_bytes=10 * layer, cap=16)
    assert copies[0].step_seconds > 0.6  # as tried, copies were slower than the trees...
    assert 1 / copies[0].step_seconds < kept.trees
    assert kept.copies_win and kept.copies > MARGIN * kept.trees  # ...but not resident
    assert not tried(cost, trees, copies, prose, manifest, residency, 0, 16).copies_win
    assert TRIAL_BAR <= 1 < MARGIN


def test_a_trial_that_fell_on_a_repeated_passage_counts_the_copies_the_text_gives():
    manifest, residency, layer, cost = _case()
    trees = _steps(cost, tokens=2, nodes=15, rounds=(4, 4, 4, 3))
    lucky = _steps(cost, tokens=8, nodes=9, rounds=())[1:]  # eight tokens a step of copies
    prose = list(range(200))  # a text that never repeats: one token a step
    repeats = list(range(20)) * 10  # one that always does
    on_prose = tried(cost, trees, lucky, prose, manifest, residency, 10 * layer, cap=16)
    on_repeats = tried(cost, trees, lucky, repeats, manifest, residency, 10 * layer, cap=16)
    assert on_repeats.copies == pytest.approx(8 * on_prose.copies)


def test_copies_are_priced_from_the_trees_steps_whatever_the_cost_models_level():
    """A profile measured on a busier machine prices every pass at 1.5 times what it took: the
    copies' price scales the trees' measured steps by the pass it would run, so it is what
    the same error-free model gives; a difference of prices priced them a third too fast."""
    manifest, residency, _, _ = _case()
    resident = plan_residency(manifest, 10**12)
    cost = _cost(0)
    steps = _steps(cost, tokens=2, nodes=15, rounds=(4, 4, 4, 3))
    dear = msgspec.structs.replace(cost, verify=Curve([1, 16], [0.015, 0.06]))
    prose = list(range(200))
    truly = predicted(cost, steps, prose, manifest, resident, draft_bytes=0, cap=16)
    priced = predicted(dear, steps, prose, manifest, resident, draft_bytes=0, cap=16)
    assert priced.trees == truly.trees
    assert priced.copies == pytest.approx(truly.copies, rel=0.1)


def test_copies_are_kept_without_a_trial_only_where_the_draft_memory_would_hold_layers():
    manifest, residency, layer, cost = _case()
    poor = _steps(cost, tokens=1, nodes=15, rounds=(4, 4, 4, 3))
    prose = list(range(200))
    holds = predicted(cost, poor, prose, manifest, residency, draft_bytes=10 * layer, cap=16)
    assert holds.grows and holds.copies_sure
    resident = plan_residency(manifest, 10**12)
    steps = _steps(_cost(0), tokens=1, nodes=15, rounds=(4, 4, 4, 3))
    alone = predicted(_cost(0), steps, prose, manifest, resident, 10 * layer, 16)
    assert alone.copies > SURE * alone.trees  # priced far faster, but nothing grows:
    assert not alone.grows and not alone.copies_sure and alone.worth_a_trial  # tried first


def test_copies_on_a_text_that_never_repeats_are_priced_as_one_node_passes():
    """Where the text finds no copies, a step of them verifies its one row: priced so, not
    as a pass of two (which priced copies on prose 0.8x as fast as they ran, resident)."""
    manifest, _, _, _ = _case()
    resident = plan_residency(manifest, 10**12)
    cost = _cost(0)
    steps = _steps(cost, tokens=2, nodes=15, rounds=(4, 4, 4, 3))
    prose = list(range(200))
    prices = predicted(cost, steps, prose, manifest, resident, draft_bytes=0, cap=16)
    # each tree step as it ran, less its drafting, scaled to a one-node pass's price
    assert prices.copies == pytest.approx(1 / cost.step_seconds(1, [], 1.0))
    assert prices.copies > 1.1 / cost.step_seconds(2, [], 1.0)
