"""Our kernels without torch (model/plain.py): the plain C library gives the torch ops' bits
on numpy arrays, for every row count, and importing it imports no torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from lever_actors.checkpoints.quantize import quantize_int8, quantize_q4k
from lever_actors.model import native, plain
from tests.model import test_q4k, test_q6k
from tests.model.test_native import int8_meaning, needs_native, weight

ROWS = (1, 2, 3, 5, 8, 17, 33)  # one-token decoding, tiles of 4 and 8 and what is left


def bits(t: torch.Tensor) -> np.ndarray:
    """A bf16 or float16 tensor as the numpy uint16 array of its bits."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def bf16(shape: tuple[int, ...], seed: int, spread: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * spread).to(torch.bfloat16)


@needs_native
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fmt", ["q4k", "q6k"])
@pytest.mark.parametrize("biased", [False, True])
def test_the_k_quant_products_give_the_torch_ops_bits(fmt, rows, biased):
    from_gguf, ours, theirs = {
        "q4k": (test_q4k.from_gguf, plain.q4k_linear, native.q4k_linear),
        "q6k": (test_q6k.from_gguf, plain.q6k_linear, native.q6k_linear),
    }[fmt]
    inputs = 768
    q, _ = from_gguf((64, inputs))
    x = bf16((rows, inputs), rows, spread=3.0)
    bias = bf16((64,), 7) if biased else None
    expected = theirs(x, q.data, q.scales, bias)
    got = ours(bits(x), q.data.numpy(), bits(q.scales), None if bias is None else bits(bias))
    np.testing.assert_array_equal(got, bits(expected))


@needs_native
@pytest.mark.parametrize("rows", [1, 9])
def test_a_q4k_matrix_with_a_padded_last_block_gives_the_torch_ops_bits(rows):
    q = quantize_q4k(weight((64, 896)))  # 896 inputs: the last block's last 128 are padding
    x = bf16((rows, 896), rows)
    expected = native.q4k_linear(x, q.data, q.scales)
    np.testing.assert_array_equal(
        plain.q4k_linear(bits(x), q.data.numpy(), bits(q.scales)), bits(expected)
    )


@needs_native
@pytest.mark.parametrize("rows", ROWS)
def test_the_int8_product_gives_the_vector_kernels_bits(rows):
    q = quantize_int8(weight((128, 256)))
    x = bf16((rows, 256), rows)
    got = plain.int8_linear(bits(x), q.data.numpy(), bits(q.scales))
    if native.loaded().stem == "avx2":
        np.testing.assert_array_equal(got, bits(native.int8_linear(x, q.data, q.scales)))
    else:  # AMX's tiles multiply x unrounded: ours round it per 32 inputs, as the vectors do
        meant = int8_meaning(x, q.data, q.scales)
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
    with pytest.raises(ValueError, match="q6k shapes"):
        plain.q6k_linear(np.zeros((1, 512), np.uint16), q.data.numpy(), bits(q.scales))
    with pytest.raises(ValueError, match="x: \\[rows, inputs\\] bf16 bits"):
        plain.q6k_linear(np.zeros((1, 256), np.float32), q.data.numpy(), bits(q.scales))


def test_the_plain_kernels_import_no_torch():
    code = (
        "import sys, numpy as np; from lever_actors.model import plain; plain.library(); "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if "KernelsUnavailable" in result.stderr:
        pytest.skip("this CPU cannot run our kernels")
    assert result.stdout.strip() == "False", result.stderr
