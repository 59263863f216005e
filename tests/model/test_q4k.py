"""The q4k format: GGUF's Q4_K values in a packing of ours, 8 outputs to a record. Their values
read back as gguf decodes the blocks, and the round-to-nearest quantizer keeps what Q4_K can
hold (its kernel: test_k_kernels.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from lever_actors.checkpoints.quantize import quantize_q4k
from lever_actors.model.formats import check_quantizable, storage_bytes
from lever_actors.model.quantized import QuantizedWeight, from_q4k_blocks, q4k_blocks
from tests.model import k_blocks
from tests.model.test_native import weight

SCALES = slice(0, 4)  # the bytes of a block's float16 scales


def random_blocks(shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Random Q4_K bytes with small finite float16 d's and dmin's."""
    return k_blocks.random_blocks(gguf.GGMLQuantizationType.Q4_K, shape, SCALES, seed)


def from_gguf(shape: tuple[int, int], seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """A q4k weight of random blocks, and their values as gguf decodes them [out, in]."""
    kind = gguf.GGMLQuantizationType.Q4_K
    return k_blocks.from_gguf(kind, from_q4k_blocks, shape, SCALES, seed)


@pytest.mark.parametrize("shape", [(64, 256), (8, 768)])
def test_values_are_what_gguf_decodes(shape):
    q, values = from_gguf(shape)
    assert torch.equal(q.dequantize(), values)
    assert q.nbytes == storage_bytes(shape, "q4k", 0) == shape[0] * shape[1] // 256 * 148
    h = torch.randn(shape[1])
    ids = torch.tensor([5, 0, 5])
    # its rows are not addressable: the whole product, in bf16 with x rounded, picked from
    scale = torch.linalg.norm(values[ids], dim=1) * torch.linalg.norm(h)
    assert ((q.products(ids, h) - values[ids] @ h).abs() <= 0.02 * scale).all()
    with pytest.raises(TypeError, match="cannot be read one by one"):
        q[ids]


def test_stored_bytes_read_back_as_the_same_weight():
    q, _ = from_gguf((64, 512))
    back = QuantizedWeight.from_bytes(
        torch.frombuffer(bytearray(q.to_bytes()), dtype=torch.uint8), "q4k", q.shape
    )
    assert torch.equal(back.data, q.data) and torch.equal(back.scales, q.scales)


def test_quantizing_rounds_to_the_nearest_step_and_keeps_what_q4_k_holds():
    w = weight((64, 512)) * torch.logspace(-1, 1, 512)  # groups of very different ranges
    w[3] = 0.0  # a row of zeros: scales of zero, values of zero
    w[5] = w[5].abs() + 0.1  # a row with no negative values: minimums of zero
    q = quantize_q4k(w)
    got = q.dequantize()
    assert torch.equal(got[3], torch.zeros(512))
    groups, values = w.view(64, 2, 8, 32), got.view(64, 2, 8, 32)
    low = groups.amin(-1, keepdim=True).clamp_max(0)
    step = (groups.amax(-1, keepdim=True) - low) / 15
    d, dmin = q.scales.view(8, 2, 2, 8).permute(2, 0, 3, 1).reshape(2, 64, 2, 1, 1).float()
    # half a step, and what rounding the step to d's and the minimum to dmin's moves (15
    # steps of half a d, half a dmin)
    assert ((values - groups).abs() <= 0.5 * step + 7.5 * d + 0.5 * dmin + 1e-6).all()
    assert torch.linalg.norm(got - w) <= 0.09 * torch.linalg.norm(w)  # int4 too: 7.8%


def test_a_last_block_short_of_256_inputs_is_stored_padded():
    w = weight((16, 96))  # inputs in groups of 32, not a whole block
    q = quantize_q4k(w)
    assert q.shape == (16, 96) and q.dequantize().shape == (16, 96)
    assert q.nbytes == storage_bytes(q.shape, "q4k", 0) == 16 // 8 * (1152 + 32)
    assert torch.linalg.norm(q.dequantize() - w) <= 0.09 * torch.linalg.norm(w)
    back = QuantizedWeight.from_bytes(
        torch.frombuffer(bytearray(q.to_bytes()), dtype=torch.uint8), "q4k", q.shape
    )
    assert torch.equal(back.dequantize(), q.dequantize())
    assert check_quantizable((16, 96), "q4k") is None
    why = check_quantizable((16, 80), "q4k")
    assert why == "q4k needs outputs in 8s and inputs in 32s, not (16, 80)"


def test_its_parts_are_the_blocks_parts():
    blocks = random_blocks((8, 512), seed=3)
    q, sc, m, d, dmin = q4k_blocks(torch.from_numpy(blocks), (8, 512))
    assert q.shape == (8, 512) and sc.shape == m.shape == (8, 2, 8) and d.shape == (8, 2)
    assert int(q.max()) <= 15 and int(sc.max()) <= 63 and int(m.max()) <= 63
    values = (d.float()[..., None] * sc.float())[..., None] * q.view(8, 2, 8, 32).float()
    values = values - (dmin.float()[..., None] * m.float())[..., None]
    decoded = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)
    assert torch.equal(values.view(8, 512), torch.from_numpy(decoded).view(8, 512))
