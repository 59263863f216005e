"""A request's place in its grammar (model/grammar.py), as masks of the logits: which tokens
may come next after the tokens taken so far."""

from __future__ import annotations

import llguidance
import numpy as np
import torch

from lever_actors.errors import ConfigError
from lever_actors.model.grammar import Grammar


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
