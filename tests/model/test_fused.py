"""One decoder layer in one call of our kernels (model/fused.py, csrc/layer.h): the same bits
as model/layers.py's ops one by one, in the hidden states and in the KV cache, for a chain and
for a tree; the layers it does not take stay in Python, and a batch of sequences shares its
products instead."""

from __future__ import annotations

import pytest
import torch

from lever_actors.checkpoints.hf import load_hf
from lever_actors.checkpoints.quantize import quantize_checkpoint
from lever_actors.model import fused, native
from lever_actors.model.placement import chain_placement, tree_placement
from lever_actors.model.transformer import Transformer
from lever_actors.model.tree import TokenTree
from lever_actors.testing.checkpoints import bf16_args, tiny_checkpoint

needs_avx2 = pytest.mark.skipif(
    native.loaded() is None or native.loaded().stem != "avx2",
    reason="the whole layer runs in one call on our AVX2 kernels only",
)


def quantized_model(weights: str) -> Transformer:
    checkpoint = load_hf(tiny_checkpoint(bf16_args(), seed=5), torch.bfloat16)
    quantized = quantize_checkpoint(checkpoint, weights)
    return Transformer(quantized.args, quantized.weights)


def decode(model: Transformer, monkeypatch, *, one_call: bool):
    """A prompt, then a tree after it, then one more token: the hidden states and the cache."""
    if not one_call:
        monkeypatch.setattr(fused, "takes", lambda *args: False)
    cache = model.new_cache(128)
    prompt = model.forward(torch.tensor([3, 14, 15, 92, 65, 35, 89, 79]), cache)
    cache.commit(8)
    tree = TokenTree((5, 6, 7, 8, 9, 10), (-1, 0, 0, 1, 1, 2))
    place = tree_placement(model.rope, cache.length, tree, model.dtype)
    nodes = model.forward(torch.tensor(tree.tokens), cache, place)
    cache.keep([0, 1, 3])
    after = model.forward(torch.tensor([11]), cache)
    monkeypatch.undo()
    return prompt, nodes, after, cache.keys, cache.values, cache.positions


@needs_avx2
@pytest.mark.parametrize("weights", ["q4", "q4k", "q6", "q8"])
def test_one_call_gives_the_bits_of_the_ops_one_by_one(weights, monkeypatch):
    model = quantized_model(weights)
    layer = model.weights.layers[0]
    assert fused.takes(torch.zeros(1, 512, dtype=torch.bfloat16), layer, model.args, 0)
    ours = decode(model, monkeypatch, one_call=True)
    theirs = decode(model, monkeypatch, one_call=False)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


@needs_avx2
def test_a_batch_shares_its_products_and_each_sequence_gets_its_bits_alone(monkeypatch):
    model = quantized_model("q4k")
    prompts = [torch.tensor([3, 14, 15, 92, 65]), torch.tensor([35, 89, 79])]
    alone, caches = [], []
    for prompt in prompts:
        cache = model.new_cache(64)
        model.forward(prompt, cache)
        cache.commit(len(prompt))
        alone.append(model.forward(torch.tensor([7]), cache))  # fused, one cache
        cache.keep([])
        caches.append(cache)
    calls = []
    monkeypatch.setattr(native, "decoder_layer", lambda *args: calls.append(args))
    blocks = [(c, chain_placement(model.rope, c.length, 1, model.dtype)) for c in caches]
    together = model.forward_blocks([torch.tensor([7]), torch.tensor([7])], blocks)
    assert not calls  # the batch took the ops one by one
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a, b)


@needs_avx2
def test_layers_it_does_not_take_stay_in_python():
    model = quantized_model("q4k")
    layer, args = model.weights.layers[0], model.args
    rows = torch.zeros(1, 512, dtype=torch.bfloat16)
    assert not fused.takes(rows.float(), layer, args, 0)  # float32 rows
    assert not fused.takes(rows, layer, bf16_args("gemma2"), 0)  # Gemma's extra norms
    dense = {**layer, "wq": torch.zeros(512, 512, dtype=torch.bfloat16)}
    assert not fused.takes(rows, dense, args, 0)  # a dense matrix


def test_nothing_runs_in_one_call_without_our_kernels(monkeypatch):
    monkeypatch.setenv("LEVER_ACTORS_KERNELS", "torch")
    native.in_use.cache_clear()
    try:
        model = quantized_model("q4k")
        rows = torch.zeros(1, 512, dtype=torch.bfloat16)
        assert not fused.takes(rows, model.weights.layers[0], model.args, 0)
    finally:
        native.in_use.cache_clear()
