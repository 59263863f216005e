"""Quantized weights: formats round-trip through bytes, kernels multiply by what the format
stores, and every row of a call equals the row computed alone."""

from __future__ import annotations

import pytest
import torch

from lever_actors.model.formats import GROUP, check_quantizable, storage_bytes
from lever_actors.model.quantized import (
    QuantizedRows,
    QuantizedWeight,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from lever_actors.model.row_blocks import dense_probe

SHAPES = [(256, 512), (512, 1536), (1536, 256)]


def weight(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("quantize", [quantize_int4, quantize_int8], ids=["int4", "int8"])
def test_the_kernel_multiplies_by_the_stored_matrix(shape, quantize):
    w = weight(shape)
    q = quantize(w)
    stored = q.dequantize()
    # 4 bits per weight: within half a step of its group's range; 8 bits: of the row's
    step = 1 / 15 if q.fmt == "int4" else 1 / 127
    assert (stored - w).abs().max() <= 2 * step * w.abs().max()
    x = torch.randn(5, shape[1]).to(torch.bfloat16)
    expected = (x.float() @ stored.T).to(torch.bfloat16)
    got = q.linear(x)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - expected.float()).abs() <= 0.02 * expected.float().abs() + 0.05).all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("quantize", [quantize_int4, quantize_int8], ids=["int4", "int8"])
def test_bytes_round_trip(shape, quantize):
    q = quantize(weight(shape))
    raw = torch.frombuffer(bytearray(q.to_bytes()), dtype=torch.uint8)
    assert raw.numel() == q.nbytes == storage_bytes(shape, q.fmt, 2)
    back = QuantizedWeight.from_bytes(raw, q.fmt, shape)
    x = torch.randn(3, shape[1]).to(torch.bfloat16)
    assert torch.equal(back.linear(x), q.linear(x))


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("n_rows", [1, 3, 33, 64, 65, 200])
def test_every_row_equals_the_row_computed_alone(fmt, n_rows):
    x, _, w, _ = dense_probe(torch.bfloat16, 512, 1536, bias=False)
    q = quantize_int4(w) if fmt == "int4" else quantize_int8(w)
    rows = x.repeat(-(-n_rows // len(x)), 1)[:n_rows]
    rows = rows * torch.linspace(0.5, 2, n_rows)[:, None].to(torch.bfloat16)
    bias = torch.randn(512).to(torch.bfloat16)
    together = q.linear(rows, bias)
    alone = torch.cat([q.linear(rows[i : i + 1], bias) for i in range(n_rows)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("out", [64, 96, 208])  # whole blocks of 64, and a shorter last one
def test_the_int4_packing_round_trips(out):
    q = torch.randint(0, 16, (out, 64), generator=torch.Generator().manual_seed(out))
    packed = pack_int4(q)
    assert packed.shape == (out, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q.to(torch.uint8))
    flat = packed.reshape(-1)
    assert flat[5] == q[5, 0] | q[37, 0] << 4  # input 0, byte 5: outputs 5 and 5 + 32
    assert flat[32 + 5] == q[5, 1] | q[37, 1] << 4  # input 1 follows input 0
    last = (out // 64) * 64 * 32  # the last block of out % 64 outputs packs in its halves
    if out % 64:
        half = out % 64 // 2
        assert flat[last] == q[out - 2 * half, 0] | q[out - half, 0] << 4


def test_embedding_rows_equal_the_packed_matrix():
    w = weight((96, 256))
    table = quantize_int4(w, "int4rows")
    matrix = quantize_int4(w)
    assert isinstance(table, QuantizedRows)
    assert table.nbytes == storage_bytes((96, 256), "int4rows", 2)
    ids = torch.tensor([5, 0, 95, 5])
    rows = table[ids]
    assert rows.dtype == torch.bfloat16
    assert torch.equal(rows.float(), matrix.dequantize()[ids].to(torch.bfloat16).float())
    back = QuantizedRows.from_bytes(
        torch.frombuffer(bytearray(table.to_bytes()), dtype=torch.uint8), (96, 256)
    )
    assert torch.equal(back[ids], rows)


def test_shapes_the_kernels_cannot_take():
    assert check_quantizable((256, 512), "int4") is None
    assert f"groups of {GROUP}" in check_quantizable((256, 40), "int4")
    assert "outputs in 16s" in check_quantizable((24, 512), "int4")
    assert check_quantizable((24, 40), "int8") is None
    assert check_quantizable((8,), "dense") is None


def test_a_float32_model_multiplies_in_bf16():
    q = quantize_int4(weight((128, 96)))
    x = torch.randn(3, 96)
    got = q.linear(x)
    assert got.dtype == torch.float32
    assert torch.equal(got, q.linear(x.to(torch.bfloat16)).float())
