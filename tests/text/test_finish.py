"""The finish rules, written once (text/finish.py): what ends a text, and a reply."""

from __future__ import annotations

from lever_actors.text.finish import finish_reason, reply_finish


def test_an_end_token_or_a_stop_string_stops_first():
    assert finish_reason(end_token=True, generated=4, max_new_tokens=4) == "stop"
    assert finish_reason(stop_string=True, generated=1, max_new_tokens=4, cut_short=True) == "stop"


def test_max_new_tokens_or_a_cut_ends_on_length():
    assert finish_reason(generated=4, max_new_tokens=4) == "length"
    assert finish_reason(generated=1, max_new_tokens=4, cut_short=True) == "length"
    assert finish_reason(cut_short=True) == "length"


def test_otherwise_the_text_goes_on():
    assert finish_reason(generated=3, max_new_tokens=4) is None
    assert finish_reason() is None


def test_a_reply_that_calls_tools_ends_on_its_calls():
    assert reply_finish("stop", called=True) == "tool_calls"
    assert reply_finish("length", called=True) == "tool_calls"
    assert reply_finish("length", called=False) == "length"
    assert reply_finish(None, called=False) is None
