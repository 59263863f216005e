"""Constrained decoding: a grammar (a JSON schema, any JSON object, a regex or a Lark
grammar) that decides which tokens may come next, through llguidance.

The target's choice at a position takes the mask of the grammar's state after the tokens
before it: the mask keeps the allowed tokens' logits and sets the rest to -inf before any
temperature, filtering or noise (sampling.py). Sequential decoding does the same one token
at a time, so a tree whose accepted path is chosen under the masks along it commits the
same tokens, whatever the draft proposed. The draft proposes under the same masks (a copy
of the matcher, `allowed_after` its nodes' paths), only so that it proposes what the
target may accept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import llguidance
import msgspec
import numpy as np
import torch

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


class Matcher:
    """One request's place in its grammar: which tokens may come next, and the tokens
    taken so far. `vocabulary` is llguidance's view of the tokenizer, `vocab_size` the
    width of the model's logits."""

    def __init__(
        self, grammar: Grammar, vocabulary: llguidance.LLTokenizer, vocab_size: int
    ) -> None:
        self._matcher = llguidance.LLMatcher(vocabulary, grammar.compiled(), log_level=0)
        self._vocab_size = vocab_size
        self._raise_on_error()

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next (only the end tokens once it is
        complete)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        self._raise_on_error()
        unpacked = np.unpackbits(bits, bitorder="little")[: self._vocab_size]
        return torch.from_numpy(unpacked.astype(bool))

    def allowed_after(self, tokens: list[int]) -> torch.Tensor:
        """[vocab] bool: the tokens allowed after `tokens` (none if it refuses one of them);
        the matcher stays where it was."""
        taken = self._matcher.try_consume_tokens(tokens)
        try:
            if taken < len(tokens):
                return torch.zeros(self._vocab_size, dtype=torch.bool)
            return self.allowed()
        finally:
            self._matcher.rollback(taken)

    def consume(self, token: int) -> None:
        """Take `token`, which `allowed()` allowed."""
        if not self._matcher.consume_token(token):
            self._raise_on_error()

    def copy(self) -> Matcher:
        """Another matcher at the same place, which goes on alone."""
        twin = object.__new__(Matcher)
        twin._matcher, twin._vocab_size = self._matcher.deep_copy(), self._vocab_size
        return twin

    def _raise_on_error(self) -> None:
        if self._matcher.is_error():
            raise ConfigError(f"grammar: {self._matcher.get_error()}")


def masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits: [..., n], allowed: [..., vocab] bool, n <= vocab -> the logits, disallowed
    ones at -inf (a draft's logits may cover only the first n ids: Transformer.proposing)."""
    return logits.masked_fill(~allowed[..., : logits.shape[-1]], -torch.inf)
