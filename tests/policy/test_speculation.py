"""The gate that decides whether a step drafts a tree: the faster kind of step as measured,
the slower one retried now and then, one-token steps tried only where they may win."""

from __future__ import annotations

import pytest

from lever_actors.policy.speculation import (
    MOST_BETWEEN_RETRIES,
    RETRY_EVERY,
    WITHIN_REACH,
    SpeculationGate,
)


def never(*_):
    raise AssertionError("the prediction was not needed")


def test_it_drafts_until_drafted_steps_are_measured():
    gate = SpeculationGate()
    assert gate.drafts(never)
    gate.observe(drafted=True, tokens=6, seconds=2.0)  # 3 tokens/s
    assert gate.drafted == 3.0


@pytest.mark.parametrize(("predicted", "drafts"), [(1.0, True), (WITHIN_REACH * 3.0, False)])
def test_one_token_steps_are_tried_only_where_predicted_within_reach(predicted, drafts):
    gate = SpeculationGate(drafted=3.0)
    assert gate.drafts(lambda: predicted) is drafts


def test_the_faster_kind_runs_and_the_slower_is_retried_ever_less_often():
    gate = SpeculationGate()
    gate.observe(drafted=True, tokens=4, seconds=1.0)  # 4 tokens/s
    gate.observe(drafted=False, tokens=1, seconds=0.2)  # 5 tokens/s: one-token steps win
    # drafting is retried after RETRY_EVERY one-token steps (the first count began above),
    # and, still the slower, after twice as many the next time
    expected = [False] * (RETRY_EVERY - 1) + [True] + [False] * 2 * RETRY_EVERY + [True]
    kinds = []
    for _ in expected:
        drafted = gate.drafts(never)
        kinds.append(drafted)
        gate.observe(drafted, tokens=4 if drafted else 1, seconds=1.0 if drafted else 0.2)
    assert kinds == expected


def test_a_far_slower_one_token_rate_is_not_retried():
    gate = SpeculationGate()
    gate.observe(drafted=True, tokens=8, seconds=2.0)  # 4 tokens/s
    gate.observe(drafted=False, tokens=1, seconds=1.0)  # 1 token/s, far below
    for _ in range(3 * RETRY_EVERY):
        assert gate.drafts(never)
        gate.observe(drafted=True, tokens=8, seconds=2.0)


def test_rates_are_moving_averages_and_a_timeless_step_teaches_nothing():
    gate = SpeculationGate()
    gate.observe(drafted=True, tokens=2, seconds=1.0)
    gate.observe(drafted=True, tokens=4, seconds=1.0)
    assert 2.0 < gate.drafted < 4.0
    before = gate.drafted
    gate.observe(drafted=True, tokens=4, seconds=0.0)
    assert gate.drafted == before


def test_the_wait_has_a_ceiling_and_starts_over_when_the_slower_kind_wins():
    gate = SpeculationGate(drafted=4.0, one_token=5.0, retry_after=MOST_BETWEEN_RETRIES)
    gate.observe(drafted=True, tokens=4, seconds=1.0)  # a retry, still slower
    assert gate.retry_after == MOST_BETWEEN_RETRIES
    gate.observe(drafted=True, tokens=20, seconds=1.0)  # a retry that now wins
    assert gate.drafted > gate.one_token and gate.retry_after == RETRY_EVERY
