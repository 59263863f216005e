"""Our kernels for GGUF's k-quants as we keep them (q4k, q6k): each computes its values'
grouped integer sums with x rounded per 256 inputs, gives a row the same bits alone or
among others, runs a draft's matrices too (torch has no kernel to prefer); where ours do not
load, the values multiply as a bf16 matrix."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lever_actors.checkpoints.quantize import quantize_q4k
from lever_actors.model import native, row_blocks
from lever_actors.model.formats import K_INPUTS
from lever_actors.model.quantized import QuantizedWeight, bf16_values
from tests.model import test_q4k, test_q6k
from tests.model.test_native import needs_native, rounded_as_int8

FORMATS = {  # format -> (a weight of random blocks and their values, our kernel)
    "q4k": (test_q4k.from_gguf, native.q4k_linear),
    "q6k": (test_q6k.from_gguf, native.q6k_linear),
}
UNFIT = {"q4k": (64, 240), "q6k": (64, 224)}  # q4k pads a last block of whole groups of 32


@pytest.fixture(params=sorted(FORMATS))
def fmt(request) -> str:
    return request.param


@needs_native
@pytest.mark.parametrize("shape", [(64, 256), (128, 768)])
def test_the_kernel_computes_the_grouped_integer_sums(fmt, shape):
    from_gguf, kernel = FORMATS[fmt]
    q, values = from_gguf(shape)
    # 20 rows: AMX multiplies q4k's on its tiles
    x = (torch.randn(20, shape[1]) * torch.logspace(-2, 1, shape[1])).to(torch.bfloat16)
    expected = rounded_as_int8(x, K_INPUTS) @ values.double().T  # per 256, as Q8_K
    got = kernel(x, q.data, q.scales).double()
    assert ((got - expected).abs() <= 0.01 * expected.abs() + 1e-4).all()


@needs_native
@pytest.mark.parametrize("outputs", [128, 24])  # 24: an odd count of q4k's records
def test_a_row_is_the_same_in_calls_of_every_size(fmt, outputs):
    from_gguf, kernel = FORMATS[fmt]
    q, _ = from_gguf((outputs, 768))
    x = (torch.randn(70, 768) * torch.logspace(-2, 2, 768)).to(torch.bfloat16)
    alone = torch.cat([kernel(x[i : i + 1], q.data, q.scales) for i in range(70)])
    # rows in fours or eights and what is left; AMX: q4k from 16 rows in tiles of 16, padded
    for n in (2, 3, 4, 5, 7, 8, 15, 16, 17, 33, 64, 70):
        assert torch.equal(kernel(x[:n], q.data, q.scales), alone[:n]), n


@needs_native
def test_a_matrix_that_fits_runs_on_ours_even_for_a_draft(fmt, monkeypatch):
    monkeypatch.setattr(native, "in_use", native.loaded)
    from_gguf, kernel = FORMATS[fmt]
    q, _ = from_gguf((64, 256))
    x = torch.randn(1, 256).to(torch.bfloat16)
    assert native.fits(fmt, q.shape) and not native.fits(fmt, UNFIT[fmt])
    expected = kernel(x, q.data, q.scales)
    assert torch.equal(q.linear(x), expected)
    assert torch.equal(replace(q, exact=False).linear(x), expected)


def test_without_our_kernels_its_values_multiply_as_a_bf16_matrix(fmt, monkeypatch):
    monkeypatch.setattr(native, "in_use", lambda: None)
    from_gguf, _ = FORMATS[fmt]
    q, values = from_gguf((64, 256))
    x = torch.randn(3, 256).to(torch.bfloat16)
    assert torch.equal(bf16_values(q), values.to(torch.bfloat16))
    assert torch.equal(q.linear(x), row_blocks.linear(x, values.to(torch.bfloat16)))


def padded_q4k(outputs: int, inputs: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A q4k weight whose last block is padded (inputs not a multiple of 256), and its values."""
    q = quantize_q4k(torch.randn(outputs, inputs, generator=torch.Generator().manual_seed(0)))
    return q, q.dequantize()


@needs_native
def test_a_padded_last_block_multiplies_zeros_in_x():
    q, values = padded_q4k(64, 896)  # the real draft's inputs: three blocks and a half
    x = (torch.randn(20, 896) * torch.logspace(-2, 1, 896)).to(torch.bfloat16)  # AMX: tiled
    padded = F.pad(x.float(), (0, 4 * K_INPUTS - 896))  # zeros to the fourth block's end
    expected = rounded_as_int8(padded, K_INPUTS)[:, :896] @ values.double().T
    got = native.q4k_linear(x, q.data, q.scales).double()
    assert ((got - expected).abs() <= 0.01 * expected.abs() + 1e-4).all()
    alone = torch.cat([native.q4k_linear(x[i : i + 1], q.data, q.scales) for i in range(20)])
    assert torch.equal(native.q4k_linear(x, q.data, q.scales), alone)
    with pytest.raises(RuntimeError, match="q4k shape"):  # x must reach into the last block
        native.q4k_linear(x[:, :768], q.data, q.scales)


def test_without_our_kernels_a_padded_matrix_multiplies_its_own_inputs(monkeypatch):
    monkeypatch.setattr(native, "in_use", lambda: None)
    q, values = padded_q4k(64, 96)
    x = torch.randn(3, 96).to(torch.bfloat16)
    assert bf16_values(q).shape == (64, 96)
    assert torch.equal(q.linear(x), row_blocks.linear(x, values.to(torch.bfloat16)))
