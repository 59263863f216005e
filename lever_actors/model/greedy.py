"""Sequential greedy decoding of one model: the oracle and the memory-resident baseline."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from lever_actors.model.transformer import Transformer


def greedy_reference(
    model: Transformer,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """The oracle: recomputes the whole sequence for every token, no state kept between steps."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        cache = model.new_cache(len(tokens))
        hidden = model.forward(torch.tensor(tokens), cache)
        token = int(model.logits(hidden[-1:]).argmax())
        tokens.append(token)
        if token in stop_ids:
            break
    return tokens[len(prompt) :]


def greedy_stream(
    model: Transformer,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
) -> Iterator[int]:
    """KV-cached greedy decoding, yielding each token as it is produced."""
    cache = model.new_cache(len(prompt) + max_new_tokens)
    pending = torch.tensor(list(prompt))
    for _ in range(max_new_tokens):
        hidden = model.forward(pending, cache)
        cache.commit(len(pending))
        token = int(model.logits(hidden[-1:]).argmax())
        yield token
        if token in stop_ids:
            return
        pending = torch.tensor([token])


def greedy_cached(
    model: Transformer,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
) -> list[int]:
    return list(greedy_stream(model, prompt, max_new_tokens, stop_ids))
