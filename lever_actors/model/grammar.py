"""Constrained decoding: a grammar (a JSON schema, any JSON object, a regex or a Lark
grammar) that decides which tokens may come next, through llguidance; model/matcher.py
masks a model's logits by it.

The target's choice at a position takes the mask of the grammar's state after the tokens
before it: the mask keeps the allowed tokens' logits and sets the rest to -inf before any
temperature, filtering or noise (choosing.py). Sequential decoding does the same one token
at a time, so a tree whose accepted path is chosen under the masks along it commits the
same tokens, whatever the draft proposed. The draft proposes under the same masks (a copy
of the matcher, `allowed_after` its nodes' paths), only so that it proposes what the
target may accept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from lever_actors.errors import ConfigError
from lever_actors.model.grammar_source import GrammarKind, compiled, refusal


class Grammar(msgspec.Struct, frozen=True):
    """A constraint on a request's text, checked on construction (ConfigError names what
    llguidance refused, or the time limit it passed: grammar_source.py). Blocking: a server
    makes it off its event loop. `source` is the schema as JSON text, the regex or the Lark
    grammar; "json" (any JSON object, OpenAI's `json_object`) needs none."""

    kind: GrammarKind
    source: str = ""

    def __post_init__(self) -> None:
        if (self.kind == "json") != (self.source == ""):
            raise ConfigError(f"grammar {self.kind!r}: " + _SOURCE_RULE)
        error = refusal(self.kind, self.source)  # in a child process, under a time limit
        if error:
            raise ConfigError(f"grammar {self.kind!r}: {error}")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Grammar:
        """Text that is JSON valid under `schema` (a dict, or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    def compiled(self) -> str:
        """The grammar in llguidance's own form."""
        return compiled(self.kind, self.source)


_SOURCE_RULE = "a schema, regex or Lark grammar needs its source; any JSON ('json') none"
