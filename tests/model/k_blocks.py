"""Random GGUF k-quant blocks (Q4_K, Q6_K) for the q4k and q6k tests, and their values as gguf
itself decodes them."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import torch

from lever_actors.model.formats import K_INPUTS
from lever_actors.model.quantized import QuantizedWeight


def random_blocks(
    kind: gguf.GGMLQuantizationType, shape: tuple[int, int], scales: slice, seed: int = 0
) -> np.ndarray:
    """Random bytes of `kind`'s blocks of an [out, in] matrix, [out, in / 256 * block bytes];
    each block's float16 scales, at bytes `scales`, small and finite."""
    rng = np.random.default_rng(seed)
    out, inputs = shape
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    raw = rng.integers(0, 256, size=(out, inputs // K_INPUTS, block_bytes), dtype=np.uint8)
    count = (scales.stop - scales.start) // 2
    d = rng.uniform(0.0001, 0.001, (out, inputs // K_INPUTS, count)).astype(np.float16)
    raw[..., scales] = d.view(np.uint8)
    return raw.reshape(out, -1)


def from_gguf(
    kind: gguf.GGMLQuantizationType,
    ours: Callable[[torch.Tensor, tuple[int, int]], QuantizedWeight],
    shape: tuple[int, int],
    scales: slice,
    seed: int = 0,
) -> tuple[QuantizedWeight, torch.Tensor]:
    """Our weight (`ours` of the blocks) of random `kind` blocks, and their values as gguf
    decodes them [out, in]."""
    blocks = random_blocks(kind, shape, scales, seed)
    values = gguf.quants.dequantize(blocks, kind)
    return ours(torch.from_numpy(blocks), shape), torch.from_numpy(values).view(shape)
