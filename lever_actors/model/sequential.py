"""Sequential decoding of one model, one token per forward: the oracle and the
memory-resident baseline. Tokens are chosen by `sampling` (greedy by default), under the
masks of a grammar's `matcher` where one is given."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from lever_actors.model.choosing import Chooser
from lever_actors.model.matcher import Matcher, masked
from lever_actors.model.sampling import GREEDY, Sampling
from lever_actors.model.transformer import Transformer


def sequential_reference(
    model: Transformer,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
    sampling: Sampling = GREEDY,
    matcher: Matcher | None = None,
) -> list[int]:
    """The oracle: recomputes the whole sequence for every token, no state kept between steps
    (but `matcher`'s, which takes each token)."""
    tokens = list(prompt)
    chooser = Chooser(sampling)
    for _ in range(max_new_tokens):
        cache = model.new_cache(len(tokens))
        hidden = model.forward(torch.tensor(tokens), cache)
        logits = model.logits(hidden[-1:])
        if matcher is not None:
            logits = masked(logits, matcher.allowed())
        [token] = chooser.choose(logits, torch.tensor([len(tokens)]))
        if matcher is not None:
            matcher.consume(token)
        tokens.append(token)
        if token in stop_ids:
            break
    return tokens[len(prompt) :]


def sequential_stream(
    model: Transformer,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
    sampling: Sampling = GREEDY,
) -> Iterator[int]:
    """KV-cached decoding, yielding each token as it is produced."""
    cache = model.new_cache(len(prompt) + max_new_tokens)
    pending = torch.tensor(list(prompt))
    chooser = Chooser(sampling)
    for _ in range(max_new_tokens):
        hidden = model.forward(pending, cache)
        cache.commit(len(pending))
        [token] = chooser.choose(model.logits(hidden[-1:]), torch.tensor([cache.length]))
        yield token
        if token in stop_ids:
            return
        pending = torch.tensor([token])


def sequential_cached(
    model: Transformer,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
    sampling: Sampling = GREEDY,
) -> list[int]:
    return list(sequential_stream(model, prompt, max_new_tokens, stop_ids, sampling))
