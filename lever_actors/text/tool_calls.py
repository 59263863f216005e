"""Tool calls as the Hermes format writes them, which Qwen2.5's and Qwen3's chat templates
ask for: each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
A grammar that makes the model call (`call_grammar`), and the calls read back out of its
text (`read_calls`)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from lever_actors.errors import ConfigError
from lever_actors.model.grammar import Grammar
from lever_actors.model.grammar_source import JSON_WHITESPACE
from lever_actors.text.stop import StopText

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


class ToolCall(msgspec.Struct, frozen=True):
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = msgspec.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def call_grammar(
    functions: Sequence[Mapping[str, Any]], many: bool = True, marker_tokens: bool = False
) -> Grammar:
    """Text of one call (or with `many`, one or more), each of one of `functions` (OpenAI's
    function definitions: name, parameters) with arguments valid under its parameters'
    schema. With `marker_tokens` the tokenizer has OPEN and CLOSE as tokens of their own
    (Qwen's), which the grammar must name as tokens: llguidance allows such a token where
    its text is due but then refuses it."""
    if not functions:
        raise ConfigError("a required tool call needs at least one tool")
    choices = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = choices[0] if len(choices) == 1 else {"anyOf": choices}
    schema["x-guidance"] = {"whitespace_pattern": JSON_WHITESPACE}
    lark = "\n".join(
        [
            r'start: call ("\n" call)*' if many else "start: call",
            rf'call: {OPEN} "\n" body "\n" {CLOSE}'
            if marker_tokens
            else rf'call: "{OPEN}\n" body "\n{CLOSE}"',
            f"body: %json {json.dumps(schema)}",
        ]
    )
    return Grammar("lark", lark)


def read_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The text before the first call, and the calls; a text whose blocks are not all
    calls (JSON with a string "name" and object "arguments") is all text, with none."""
    calls = []
    for block in _CALL.findall(text):
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        if not (
            isinstance(call, dict)
            and isinstance(call.get("name"), str)
            and isinstance(call.get("arguments"), dict)
        ):
            return text, []
        calls.append(ToolCall(call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
    if not calls:
        return text, []
    return text[: text.index(OPEN)].rstrip(), calls


class CallText:
    """A stream's text with its tool calls held back: what comes before the first call goes
    out as it comes (text that may begin one waits until it cannot); the rest waits for the
    end, where it is read as calls, or emitted as text if it is none."""

    def __init__(self) -> None:
        self._before = StopText((OPEN,))
        self._calling = False
        self._text = ""  # all of it

    def push(self, delta: str) -> str:
        """A token's text -> what may go out now."""
        self._text += delta
        if self._calling:
            return ""
        out, self._calling = self._before.push(delta)
        return out

    def end(self) -> tuple[str, list[ToolCall]]:
        """At the end: the text still to go out, and the calls."""
        _, calls = read_calls(self._text)
        if calls:
            return "", calls
        return self._text[self._before.sent :], []
