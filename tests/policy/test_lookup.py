"""Proposals copied from the committed text (policy/lookup.py)."""

from __future__ import annotations

from lever_actors.policy.lookup import ContextIndex


def test_a_paths_end_continues_as_it_did_at_its_last_earlier_occurrence():
    index = ContextIndex([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 1])
    assert index.follower([2, 3, 4]) == 6  # the later occurrence wins
    assert index.follower([2, 3, 4, 6]) == 7
    assert index.follower([9, 9, 2, 3]) == 4  # the path's last 3 tokens count


def test_the_texts_end_counts_before_a_short_path():
    index = ContextIndex([7, 8, 9, 5, 7, 8])
    assert index.follower([9]) == 5  # 7 8 | 9
    index.extend([9])
    assert index.follower([]) == 5  # the text's own end, seen once before


def test_no_follower_without_an_earlier_occurrence():
    index = ContextIndex([1, 2, 3, 4])
    assert index.follower([]) is None  # 2 3 4 only ends the text: nothing followed it
    assert index.follower([4, 4]) is None
    assert ContextIndex([1]).follower([]) is None


def test_extending_the_text_finds_what_it_adds():
    index = ContextIndex([1, 2, 3])
    index.extend([4, 1, 2])
    assert index.follower([3]) == 4
    index.extend([3, 5])
    assert index.follower([1, 2, 3]) == 5  # the newer occurrence
