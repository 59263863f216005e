"""Our kernels without torch (model/plain.py): the plain C library gives the torch ops' bits
on numpy arrays, for every row count, and importing it imports no torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from lever_actors.checkpoints.quantize import quantize_int8, quantize_q4k, quantize_tensor
from lever_actors.errors import ConfigError
from lever_actors.model import fused, native, plain, plain_from_torch, plain_model
from lever_actors.model.frequencies import shared_inverse_frequencies
from lever_actors.model.placement import chain_placement, tree_placement
from lever_actors.model.plain_from_torch import bits, matrix
from lever_actors.model.rope import Rope
from lever_actors.model.sampling import Sampling
from lever_actors.model.sequential import sequential_cached
from lever_actors.model.tree import TokenTree
from lever_actors.testing.checkpoints import bf16_args
from tests.model import test_q4k, test_q6k
from tests.model.test_fused import needs_avx2, quantized_model
from tests.model.test_native import needs_native, rounded_as_int8, weight

ROWS = (1, 2, 3, 5, 8, 17, 33)  # one-token decoding, tiles of 4 and 8 and what is left


def bf16(shape: tuple[int, ...], seed: int, spread: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * spread).to(torch.bfloat16)


@needs_native
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fmt", ["q4k", "q6k"])
@pytest.mark.parametrize("biased", [False, True])
def test_the_k_quant_products_give_the_torch_ops_bits(fmt, rows, biased):
    from_gguf, theirs = {
        "q4k": (test_q4k.from_gguf, native.q4k_linear),
        "q6k": (test_q6k.from_gguf, native.q6k_linear),
    }[fmt]
    inputs = 768
    q, _ = from_gguf((64, inputs))
    x = bf16((rows, inputs), rows, spread=3.0)
    bias = bf16((64,), 7) if biased else None
    expected = theirs(x, q.data, q.scales, bias)
    got = plain.linear(bits(x), matrix(q), None if bias is None else bits(bias))
    np.testing.assert_array_equal(got, bits(expected))


@needs_native
@pytest.mark.parametrize("rows", [1, 9])
def test_a_q4k_matrix_with_a_padded_last_block_gives_the_torch_ops_bits(rows):
    q = quantize_q4k(weight((64, 896)))  # 896 inputs: the last block's last 128 are padding
    x = bf16((rows, 896), rows)
    expected = native.q4k_linear(x, q.data, q.scales)
    np.testing.assert_array_equal(plain.linear(bits(x), matrix(q)), bits(expected))


@needs_native
@pytest.mark.parametrize("rows", ROWS)
def test_the_int8_product_gives_the_vector_kernels_bits(rows):
    q = quantize_int8(weight((128, 256)))
    x = bf16((rows, 256), rows)
    got = plain.linear(bits(x), matrix(q))
    if native.loaded().stem == "avx2":
        np.testing.assert_array_equal(got, bits(native.int8_linear(x, q.data, q.scales)))
    else:  # AMX's tiles multiply x unrounded: ours round it per 32 inputs, as the vectors do
        meant = (rounded_as_int8(x) @ q.data.double().T) * q.scales.double()
        as_float = torch.from_numpy(got.astype(np.int32) << 16).view(torch.float32).double()
        assert ((as_float - meant).abs() <= 0.01 * meant.abs() + 1e-3).all()


@needs_native
@pytest.mark.parametrize("rows", [1, 70])
def test_rms_norm_and_rope_give_the_torch_ops_bits(rows):
    x, w = bf16((rows, 128), 1, spread=5.0), bf16((128,), 2)
    np.testing.assert_array_equal(
        plain.rms_norm(bits(x), bits(w), 1e-6), bits(native.rms_norm(x, w, 1e-6))
    )
    heads = bf16((rows, 4, 32), 3).transpose(0, 1)  # [H, n, hd] viewed by head, as a projection's
    cos, sin = bf16((rows, 32), 4), bf16((rows, 32), 5)
    strided = bits(bf16((rows, 4, 32), 3)).transpose(1, 0, 2)
    np.testing.assert_array_equal(
        plain.rope(strided, bits(cos), bits(sin)), bits(native.rope(heads, cos, sin))
    )


@needs_native
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_attention_gives_the_torch_ops_bits(masked, group):
    n, kv, length, hd = 5, 2, 37, 64
    q = bf16((kv * group, n, hd), 1)
    cache = bf16((2, kv, length + 11, hd), 2)  # room past the length, as a KV cache has
    keys, values = cache[0, :, :length], cache[1, :, :length]
    mask = (
        torch.rand(n, length, generator=torch.Generator().manual_seed(3)) < 0.6 if masked else None
    )
    if mask is not None:
        mask[:, 0] = True  # every row sees a key
    expected = native.attend(q, keys, values, mask, 0.125, None)
    room = bits(cache)
    got = plain.attend(
        bits(q), room[0, :, :length], room[1, :, :length],
        None if mask is None else mask.numpy(), 0.125, None,
    )  # fmt: skip
    np.testing.assert_array_equal(got, bits(expected))


@needs_native
def test_bad_shapes_are_refused_before_the_kernel_runs():
    q, _ = test_q6k.from_gguf((64, 256))
    with pytest.raises(ValueError, match="q6k \\(64, 256\\) cannot multiply x \\(1, 512\\)"):
        plain.linear(np.zeros((1, 512), np.uint16), matrix(q))
    with pytest.raises(ValueError, match="x: \\[rows, inputs\\] bf16 bits"):
        plain.linear(np.zeros((1, 256), np.float32), matrix(q))
    cut = plain.Matrix("q6k", (64, 256), q.data.numpy()[:32], bits(q.scales))
    with pytest.raises(ValueError, match="q6k \\(64, 256\\): data \\(32, 208\\)"):
        plain.linear(np.zeros((1, 256), np.uint16), cut)


def test_the_plain_kernels_import_no_torch():
    code = (
        "import sys, numpy as np; from lever_actors.model import plain; plain.library(); "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if "KernelsUnavailable" in result.stderr:
        pytest.skip("this CPU cannot run our kernels")
    assert result.stdout.strip() == "False", result.stderr


@needs_native
def test_swiglu_gives_the_torch_ops_bits_within_a_rounding_of_torchs_silu():
    gate, up = bf16((7, 99), 1, spread=4.0), bf16((7, 99), 2)  # 99: a tail past whole vectors
    ours = native.swiglu(gate, up)
    np.testing.assert_array_equal(plain.swiglu(bits(gate), bits(up)), bits(ours))
    torchs = (torch.nn.functional.silu(gate) * up).float()
    assert ((ours.float() - torchs).abs() <= 2**-7 * torchs.abs() + 1e-30).all()


def plain_rows(place, n: int) -> plain.Rows:
    return plain.Rows(
        place.positions.numpy(), bits(place.cos), bits(place.sin),
        None if place.offsets is None else place.offsets.numpy(),
        None if place.mask is None else place.mask.numpy(),
        place.span if place.span is not None else n,
    )  # fmt: skip


@needs_avx2
@pytest.mark.parametrize("weights", ["q4", "q4k", "q6", "q8"])
def test_a_whole_layer_gives_the_torch_ops_bits_for_a_chain_and_a_tree(weights):
    model = quantized_model(weights)
    args = model.args
    shape = plain.Shape(args.n_heads, args.head_dim, args.norm_eps, args.head_dim**-0.5, 0.0)
    layers = [plain_from_torch.layer(w) for w in model.weights.layers]
    theirs = model.new_cache(64)
    ours = plain_model.KVCache(args, 64)
    x = bf16((8, args.d_model), 9)
    tree = TokenTree((5, 6, 7, 8, 9, 10), (-1, 0, 0, 1, 1, 2))
    for step, place in enumerate([None, "tree"]):
        if place is None:
            place = chain_placement(model.rope, theirs.length, 8, model.dtype)
        else:
            theirs.commit(8)
            place = tree_placement(model.rope, theirs.length, tree, model.dtype)
            x = x[:6]
        n = x.shape[0]
        expected, got = x, bits(x)
        for i, w in enumerate(model.weights.layers):
            expected = fused.layer_forward(expected, w, args, theirs, i, place)
            got = plain.decoder_layer(
                got, layers[i], ours, i, theirs.length, plain_rows(place, n), shape
            )
            np.testing.assert_array_equal(got, bits(expected), err_msg=f"step {step}, layer {i}")
    np.testing.assert_array_equal(ours.keys, bits(theirs.keys))
    np.testing.assert_array_equal(ours.values, bits(theirs.values))
    np.testing.assert_array_equal(ours.positions, theirs.positions.numpy())


@needs_native
def test_rope_tables_give_the_torch_paths_bits_and_stay_within_a_rounding_of_torchs():
    args = quantized_model("q4k").args
    rope = Rope(args)
    positions = torch.arange(0, 40_000, 97)
    cos, sin = rope.tables(positions, torch.bfloat16)  # bf16 on our kernels: the shared speeds
    ours = plain.rope_tables(positions.numpy(), shared_inverse_frequencies(args))
    np.testing.assert_array_equal(ours[0], bits(cos))
    np.testing.assert_array_equal(ours[1], bits(sin))
    angles = positions[:, None].double() * rope.inv_freq.double()
    assert (cos[:, : args.head_dim // 2].double() - angles.cos()).abs().max() <= 2**-8


def plain_of(model) -> plain_model.Model:
    w = model.weights
    return plain_model.Model(
        model.args, plain_from_torch.weights(w.embed, w.layers, w.final_norm, w.lm_head)
    )


@needs_native
@pytest.mark.parametrize("weights", ["q4", "q4k", "q6", "q8"])
def test_the_plain_model_gives_the_torch_models_bits_through_a_prompt_a_tree_and_a_token(weights):
    if weights in ("q4", "q8") and native.loaded().stem == "amx":
        pytest.skip("AMX's tiles multiply int4 and int8 by x unrounded: the plain path refuses")
    theirs = quantized_model(weights)
    ours = plain_of(theirs)
    cache, room = theirs.new_cache(64), ours.new_cache(64)
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    expected, got = theirs.forward(torch.tensor(prompt), cache), ours.forward(prompt, room)
    np.testing.assert_array_equal(got, bits(expected))
    np.testing.assert_array_equal(ours.logits(got), bits(theirs.logits(expected)))
    cache.commit(8), room.commit(8)
    tree = TokenTree((5, 6, 7, 8, 9, 10), (-1, 0, 0, 1, 1, 2))
    place = tree_placement(theirs.rope, cache.length, tree, theirs.dtype)
    rows = ours.rows(place.positions.numpy(), place.mask.numpy())
    expected = theirs.forward(torch.tensor(tree.tokens), cache, place)
    np.testing.assert_array_equal(ours.forward(list(tree.tokens), room, rows), bits(expected))
    cache.keep([0, 1, 3]), room.keep([0, 1, 3])
    expected = theirs.logits(theirs.forward(torch.tensor([11]), cache))
    np.testing.assert_array_equal(ours.logits(ours.forward([11], room)), bits(expected))
    np.testing.assert_array_equal(room.keys, bits(cache.keys))
    np.testing.assert_array_equal(room.positions, cache.positions.numpy())


@needs_native
def test_plain_greedy_decoding_gives_the_torch_models_tokens():
    theirs = quantized_model("q4k")
    ours, prompt = plain_of(theirs), [3, 14, 15, 92, 65]
    tokens = list(plain_model.token_stream(ours, prompt, 24))
    assert tokens == sequential_cached(theirs, prompt, 24)
    stop = frozenset({tokens[5]})  # ends on its first stop token, which it yields
    stopped = list(plain_model.token_stream(ours, prompt, 24, stop))
    assert (
        stopped
        == sequential_cached(theirs, prompt, 24, stop)
        == tokens[: tokens.index(tokens[5]) + 1]
    )


@needs_native
@pytest.mark.parametrize("seed", [0, 5, 2**64 - 1])
def test_plain_seeded_sampling_draws_the_torch_models_tokens(seed):
    theirs = quantized_model("q6")
    ours, prompt = plain_of(theirs), [3, 14, 15, 92, 65]
    sampling = Sampling(temperature=1.7, top_k=40, top_p=0.95, seed=seed)
    tokens = list(plain_model.token_stream(ours, prompt, 24, sampling=sampling))
    assert tokens == sequential_cached(theirs, prompt, 24, sampling=sampling)
    assert tokens != list(plain_model.token_stream(ours, prompt, 24))  # it did sample


def test_int4_rows_decode_as_torchs_decode_rows():
    table = torch.randn(40, 96) * torch.logspace(-3, 1, 96)
    rows = quantize_tensor(table, "int4rows", torch.bfloat16)
    ids = [0, 39, 7, 7, 12]
    ours = plain_model.Int4Rows(rows.records.numpy(), 96).rows(ids)
    np.testing.assert_array_equal(ours, bits(rows[torch.tensor(ids)]))


def test_a_model_the_plain_path_cannot_run_is_refused_in_one_line():
    args = bf16_args("gemma2")
    with pytest.raises(ConfigError, match="^the plain path cannot run this model: Gemma's"):
        plain_model.Model(args, None)  # type: ignore[arg-type]


@needs_avx2
def test_a_long_prompt_goes_through_in_chunks_of_rows_with_the_same_bits(monkeypatch):
    ours = plain_of(quantized_model("q4k"))
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    whole_cache, chunked_cache = ours.new_cache(16), ours.new_cache(16)
    whole = ours.forward(prompt, whole_cache)
    monkeypatch.setattr(plain_model, "rows_per_chunk", lambda args, keys: 3)
    chunked = ours.forward(prompt, chunked_cache)
    np.testing.assert_array_equal(chunked, whole)
    np.testing.assert_array_equal(chunked_cache.keys, whole_cache.keys)
    assert chunked_cache.length == 0  # all ten pending, as one forward leaves them
