"""The q6k format: GGUF's Q6_K blocks kept as the file has them. Their values read back as
gguf decodes them, and the round-to-nearest quantizer packs what it means (its kernel:
test_k_kernels.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from lever_actors.checkpoints.quantize import quantize_q6k
from lever_actors.model.formats import Q6K_BYTES, storage_bytes
from lever_actors.model.quantized import QuantizedWeight, from_q6k_blocks
from lever_actors.model.weights import row_range
from tests.model import k_blocks
from tests.model.test_native import weight

SCALES = slice(Q6K_BYTES, Q6K_BYTES + 2)  # the bytes of a block's float16 scales


def random_blocks(shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Random Q6_K bytes with small finite float16 d's."""
    return k_blocks.random_blocks(gguf.GGMLQuantizationType.Q6_K, shape, SCALES, seed)


def from_gguf(shape: tuple[int, int], seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """A q6k weight of random blocks, and their values as gguf decodes them [out, in]."""
    kind = gguf.GGMLQuantizationType.Q6_K
    return k_blocks.from_gguf(kind, from_q6k_blocks, shape, SCALES, seed)


@pytest.mark.parametrize("shape", [(64, 256), (8, 768)])
def test_values_are_what_gguf_decodes(shape):
    q, values = from_gguf(shape)
    assert torch.equal(q.dequantize(), values)
    assert q.nbytes == storage_bytes(shape, "q6k", 0) == shape[0] * shape[1] // 256 * 210
    ids = torch.tensor([5, 0, 5])
    assert torch.equal(q[ids], values[ids].to(torch.bfloat16))
    h = torch.randn(shape[1])
    assert torch.allclose(q.products(ids, h), values[ids] @ h, rtol=1e-5, atol=1e-5)


def test_stored_bytes_read_back_as_the_same_weight():
    q, _ = from_gguf((64, 512))
    back = QuantizedWeight.from_bytes(
        torch.frombuffer(bytearray(q.to_bytes()), dtype=torch.uint8), "q6k", q.shape
    )
    assert torch.equal(back.data, q.data) and torch.equal(back.scales, q.scales)
    rows = row_range(q, 8, 24)
    assert rows.shape == (16, 512) and torch.equal(rows.dequantize(), q.dequantize()[8:24])


def test_quantizing_rounds_to_the_nearest_step_and_packs_what_it_means():
    w = weight((64, 512)) * torch.logspace(-1, 1, 512)  # groups of very different ranges
    w[3] = 0.0  # a row of zeros: scales of zero, values of zero
    q = quantize_q6k(w)
    got = q.dequantize()
    blocks = torch.cat(
        (q.data.view(64, 2, Q6K_BYTES), q.scales.view(torch.uint8).view(64, 2, 2)), -1
    )
    decoded = gguf.quants.dequantize(blocks.reshape(64, -1).numpy(), gguf.GGMLQuantizationType.Q6_K)
    assert torch.equal(got, torch.from_numpy(decoded).view(64, 512))  # gguf reads it alike
    assert torch.equal(got[3], torch.zeros(512))
    sc = q.data.view(64, 2, Q6K_BYTES)[..., 192:].view(torch.int8).float()  # [rows, blocks, 16]
    step = (q.scales.float()[..., None] * sc).view(64, 32).repeat_interleave(16, -1)
    clamped = (w.abs() - 31.5 * step).clamp_min(0)  # past the last level the rounded scale has
    assert ((got - w).abs() <= 0.5 * step + clamped + 1e-6).all()
    assert torch.linalg.norm(got - w) <= 0.02 * torch.linalg.norm(w)
