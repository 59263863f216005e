"""Stop strings left out of the text, token by token: what is emitted, joined, is the text
up to where the first stop string begins, whichever tokens it spans; nothing emitted is
taken back; text that cannot begin one is not held back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lever_actors.text.stop import StopText

letters = st.text(alphabet="ab\n", max_size=4)


def expected(deltas: list[str], stops: list[str]) -> tuple[str, int | None]:
    """The text and the index of the delta that completed a stop string (None: none)."""
    text = ""
    for i, delta in enumerate(deltas):
        text += delta
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], i
    return text, None


@given(deltas=st.lists(letters, max_size=12), stops=st.lists(letters.filter(bool), max_size=3))
def test_the_emitted_text_is_the_text_up_to_the_first_stop_string(deltas, stops):
    out = StopText(stops)
    emitted, stopped_at = "", None
    for i, delta in enumerate(deltas):
        more, stopped = out.push(delta)
        emitted += more
        if stopped:
            stopped_at = i
            break
    else:
        emitted += out.flush()
    assert (emitted, stopped_at) == expected(deltas, stops)


@given(deltas=st.lists(letters, max_size=12), stops=st.lists(letters.filter(bool), max_size=3))
def test_only_a_tail_that_may_begin_a_stop_string_is_held_back(deltas, stops):
    out = StopText(stops)
    for delta in deltas:
        _, stopped = out.push(delta)
        if stopped:
            return
        held = out.text[out.sent :]  # what was not emitted: a proper start of a stop string
        assert not held or any(s.startswith(held) and len(s) > len(held) for s in stops)


def test_keep_emits_each_token_whole_with_the_stop_string():
    out = StopText(["\n\n"], keep=True)
    assert out.push("a\n") == ("a\n", False)
    assert out.push("\nb") == ("\nb", True)
