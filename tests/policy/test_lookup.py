"""Proposals copied from the committed text (policy/lookup.py)."""

from __future__ import annotations

from lever_actors.policy.lookup import ContextIndex


def test_a_paths_end_continues_as_it_did_at_its_last_earlier_occurrence():
    index = ContextIndex([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 1])
    assert index.continuation([2, 3, 4], 3) == [6, 7, 1]  # the later occurrence wins
    assert index.continuation([2, 3, 4], 1) == [6]


def test_the_texts_end_counts_before_a_short_path():
    index = ContextIndex([7, 8, 9, 5, 7, 8])
    assert index.continuation([9], 4) == [5, 7, 8]  # 7 8 | 9
    index.extend([9])
    assert index.continuation([], 2) == [5, 7]  # the text's own end, seen once before


def test_no_continuation_without_an_earlier_occurrence():
    index = ContextIndex([1, 2, 3, 4])
    assert index.continuation([], 5) == []  # 2 3 4 only ends the text: nothing followed it
    assert index.continuation([4, 4], 5) == []
    assert ContextIndex([1]).continuation([], 5) == []


def test_extending_the_text_finds_what_it_adds():
    index = ContextIndex([1, 2, 3])
    index.extend([4, 1, 2])
    assert index.continuation([3], 2) == [4, 1]
    index.extend([3, 5])
    assert index.continuation([1, 2, 3], 3) == [5]  # the newer occurrence, cut at the end
