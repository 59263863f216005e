"""Our transformer math equals transformers' on tiny random float64 checkpoints."""

from __future__ import annotations

import pytest
import torch

from lever_actors.checkpoints.hf import load_hf
from lever_actors.model.sequential import sequential_cached, sequential_reference
from lever_actors.model.transformer import Transformer
from tests.tiny_hf import (
    ARCHS,
    full_precision_norms,
    hf_cases,
    save_tiny,
    their_greedy,
    tiny_model,
)

CASES = hf_cases()


@pytest.fixture(params=CASES)
def pair(request, tmp_path):
    arch, kwargs = request.param
    theirs = tiny_model(arch, **kwargs)
    ours = load_hf(save_tiny(theirs, tmp_path / arch), torch.float64)
    return theirs, Transformer(ours.args, ours.weights)


def test_logits_equal_transformers(pair):
    theirs, ours = pair
    tokens = torch.randint(
        0, ours.args.vocab_size, (40,), generator=torch.Generator().manual_seed(1)
    )
    with full_precision_norms(), torch.no_grad():
        expected = theirs(tokens[None]).logits[0]
    got = ours.logits(ours.forward(tokens, ours.new_cache(len(tokens))))
    assert got.dtype == torch.float64
    assert (got - expected).abs().max().item() <= 1e-9


def test_cached_chunks_equal_one_pass(pair):
    _, ours = pair
    tokens = torch.arange(30) % ours.args.vocab_size
    whole = ours.logits(ours.forward(tokens, ours.new_cache(30)))
    cache = ours.new_cache(30)
    parts = []
    for chunk in (tokens[:7], tokens[7:8], tokens[8:20], tokens[20:]):
        parts.append(ours.logits(ours.forward(chunk, cache)))
        cache.commit(len(chunk))
    assert (torch.cat(parts) - whole).abs().max().item() <= 1e-12


@pytest.mark.parametrize(
    "decode", [sequential_reference, sequential_cached], ids=["no-cache", "kv-cache"]
)
def test_greedy_equals_transformers_generate(pair, decode):
    theirs, ours = pair
    prompt = [3, 14, 15, 92, 65, 35]
    assert decode(ours, prompt, 32) == their_greedy(theirs, prompt, 32)


@pytest.mark.parametrize("arch", ARCHS)
def test_stop_token_ends_generation(arch, tmp_path):
    ours = load_hf(save_tiny(tiny_model(arch), tmp_path), torch.float64)
    model = Transformer(ours.args, ours.weights)
    free = sequential_cached(model, [1, 2, 3], 12)
    stop = free[4]
    first = free.index(stop)
    assert sequential_cached(model, [1, 2, 3], 12, frozenset({stop})) == free[: first + 1]
    assert sequential_reference(model, [1, 2, 3], 12, frozenset({stop})) == free[: first + 1]
