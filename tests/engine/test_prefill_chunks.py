"""A long block (a prompt, a tree after one) goes through each layer a few rows at a time
(`layers_forward`): the same hidden states and KV as the block whole (bit for bit in bf16),
and the engine's output still equals sequential decoding, in float64 and in bf16, whatever
the chunk."""

from __future__ import annotations

from unittest import mock

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.engine import Engine
from lever_actors.model import layers
from lever_actors.model.layers import rows_per_chunk
from lever_actors.model.placement import chain_placement, tree_placement
from lever_actors.model.shapes import CHUNK_BYTES
from lever_actors.model.transformer import Transformer
from lever_actors.model.tree import TokenTree
from lever_actors.testing import bf16_engine_cases, engine_cases, reference_tokens
from lever_actors.testing.checkpoints import TINY_ARGS, bf16_args, model_pair


def chunks_of(rows: int):
    """Every long block through a layer `rows` rows at a time."""
    return mock.patch.object(layers, "rows_per_chunk", lambda args, keys: rows)


def tiny_model(args, dtype) -> Transformer:
    layout = model_pair(args, "identical", 0, dtype=dtype).target
    checkpoint = load_checkpoint(layout, dtype)
    return Transformer(checkpoint.args, checkpoint.weights)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_a_block_in_chunks_gives_the_same_hidden_states_and_kv_bit_for_bit(dtype, rows):
    args = TINY_ARGS if dtype == torch.float64 else bf16_args()
    model = tiny_model(args, dtype)
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7])
    context = 3

    def run():
        cache = model.new_cache(32)
        model.forward(tokens[:context], cache)
        cache.commit(context)
        tree = TokenTree(tuple(tokens[context:].tolist()), (-1, 0, 1, 2, 3, 4, 4, 6, 0, 8, 9))
        place = tree_placement(model.rope, context, tree, model.dtype)
        return model.forward(tokens[context:], cache, place), cache

    whole, whole_cache = run()
    with chunks_of(rows):
        chunked, chunked_cache = run()
    end = len(tokens)
    pairs = [
        (whole, chunked),
        (whole_cache.keys[:, :, :end], chunked_cache.keys[:, :, :end]),
        (whole_cache.values[:, :, :end], chunked_cache.values[:, :, :end]),
    ]
    for a, b in pairs:
        if dtype == torch.bfloat16:  # our row kernels: every rounding as the block whole
            assert torch.equal(a, b)
        else:  # float64 sums over however many keys come: rounding at 1e-16, no more
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_chunks_are_sized_to_the_temporaries_of_a_layer():
    real = msgspec.structs.replace(TINY_ARGS, ffn_dim=8960, n_heads=12)
    rows = rows_per_chunk(real, 1600)
    assert 100 < rows < 300  # about 180 KiB a row: 32 MiB's worth
    assert 4 * rows * (3 * 8960 + 12 * 1600) <= CHUNK_BYTES
    assert rows_per_chunk(real, 10**9) == 1


def test_a_chain_in_chunks_writes_each_position_where_the_whole_chain_does():
    model = tiny_model(TINY_ARGS, torch.float64)
    place = chain_placement(model.rope, 0, 7, model.dtype)
    chunk = place.chunk(2, 5)
    assert chunk.offsets.tolist() == [2, 3, 4] and chunk.span == 5
    assert chunk.mask.shape == (3, 5)


async def assert_chunked_engine_matches(case, rows: int) -> None:
    """The engine, its prompts `rows` rows at a time, against the reference computed whole
    (outside the patch: chunks on both sides would prove less)."""
    config = case.engine_config()
    expected = reference_tokens(config.target, case.prompt, case.max_new_tokens)
    with chunks_of(rows):
        async with Engine.open(config) as engine:
            result = await engine.generate(case.prompt, max_new_tokens=case.max_new_tokens)
    assert result.tokens == expected


@settings(max_examples=max(1, settings.default.max_examples // 4))
@given(case=engine_cases(), rows=st.integers(1, 4))
async def test_the_engine_with_prompts_in_chunks_equals_sequential_decoding(case, rows):
    await assert_chunked_engine_matches(case, rows)


@settings(max_examples=max(1, settings.default.max_examples // 30))
@given(case=bf16_engine_cases(), rows=st.integers(1, 3))
async def test_prompts_in_chunks_in_bf16_equal_sequential_decoding_in_bf16(case, rows):
    await assert_chunked_engine_matches(case, rows)
