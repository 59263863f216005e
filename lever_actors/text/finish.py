"""Why a request's text ends, decided here alone: by the engine for each token (steps.py),
by `generate --model` for its sequential decoding, and by the server for a reply.

"stop": after one of the tokenizer's end tokens, or after the token that completes one of
the request's stop strings. "length": once it has `max_new_tokens`, or where it was cut
short (the step that ended past its deadline, or the server's shutdown). A reply whose text
calls tools ends "tool_calls", whatever ended its text."""

from __future__ import annotations

from typing import Literal

from lever_actors.channels.messages import FinishReason

ReplyFinish = FinishReason | Literal["tool_calls"]
# a text cut short (past its deadline, by the server's shutdown) ends as one at its length
CUT_SHORT: FinishReason = "length"


def finish_reason(
    *,
    end_token: bool = False,
    stop_string: bool = False,
    generated: int = 0,
    max_new_tokens: int | None = None,
    cut_short: bool = False,
) -> FinishReason | None:
    """Whether the text ends at its latest token, and why (None: it goes on)."""
    if end_token or stop_string:
        return "stop"
    if cut_short:
        return CUT_SHORT
    if max_new_tokens is not None and generated >= max_new_tokens:
        return "length"
    return None


def reply_finish(finish: FinishReason | None, called: bool) -> ReplyFinish | None:
    """A reply's finish reason: "tool_calls" where its text called tools, else its text's."""
    return "tool_calls" if called else finish
