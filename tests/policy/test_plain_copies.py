"""The plain path's copies (policy/plain_copies.py): proposed where the text repeats itself,
as many as the observed acceptance and row cost pay for, none where they do not."""

from __future__ import annotations

import pytest

from lever_actors.policy.plain_copies import CAP, ROW_COST_PRIOR, CopyProposer

LIST = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]


def test_nothing_is_copied_where_the_text_never_repeats_itself():
    assert CopyProposer().proposed(list(range(40))) == []


def test_the_tokens_that_followed_the_texts_end_before_are_copied():
    copies = CopyProposer()
    proposed = copies.proposed([*LIST, 1, 2, *LIST[:3]])
    assert proposed and proposed == LIST[3 : 3 + len(proposed)]


def test_copies_that_keep_being_taken_grow_the_chain_up_to_the_cap():
    copies = CopyProposer()
    first = len(copies.proposed(LIST * 3))
    for _ in range(40):
        copies.verified(rows=1 + CAP, copies=CAP, taken=CAP, seconds=0.0)
    assert first < len(copies.proposed([])) == CAP


def test_copies_the_target_refuses_stop_being_proposed():
    copies = CopyProposer()
    assert copies.proposed(LIST * 3)
    for _ in range(20):
        copies.verified(rows=3, copies=2, taken=0, seconds=0.0)
    assert copies.acceptance() < ROW_COST_PRIOR
    assert copies.proposed([]) == []


def test_the_row_cost_is_learned_from_timed_passes_against_the_one_row_pass():
    copies = CopyProposer()
    copies.verified(rows=1, copies=0, taken=0, seconds=0.010)
    for _ in range(60):
        copies.verified(rows=5, copies=4, taken=4, seconds=0.030)  # 0.5 a row
    assert copies.row_cost == pytest.approx(0.5, abs=0.05)
    copies.verified(rows=100, copies=4, taken=4, seconds=9.0)  # a prompt's pass: not timed
    assert copies.row_cost == pytest.approx(0.5, abs=0.05)


def test_each_pass_records_the_tokens_it_committed():
    copies = CopyProposer()
    copies.verified(rows=9, copies=2, taken=2, seconds=0.1)
    copies.verified(rows=1, copies=0, taken=0, seconds=0.01)
    copies.verified(rows=4, copies=3, taken=1, seconds=0.02)
    assert copies.committed == [3, 1, 2]
    assert (copies.passes, copies.taken) == (3, 3)
