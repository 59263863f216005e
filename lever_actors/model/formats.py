"""How a flash layout stores each format of weight, without torch: the formats, their block
sizes and the bytes a tensor of each takes (model/quantized.py describes the formats and
computes with them)."""

from __future__ import annotations

import math
from typing import Literal

Format = Literal["dense", "int4", "int8", "q6k", "q4k", "int4rows"]
MatrixFormat = Literal["int4", "int8", "q6k", "q4k"]
QUANTIZED_FORMATS: tuple[str, ...] = ("int4", "int8", "q6k", "q4k", "int4rows")
# matrices stored row after row, each row's values whole in its own bytes (then its scales)
ROW_MATRIX_FORMATS: tuple[str, ...] = ("int8", "q6k")
K_FORMATS = ("q4k", "q6k")  # GGUF's Q4_K and Q6_K values as we keep them: torch has no kernel
GROUP = 32  # inputs per int4 scale: Q4_K's sub-block, so its values convert without requantizing
PACK_TILES = 2  # torch's inner_k_tiles for its CPU int4 packing
K_INPUTS = 256  # a k-quant block's inputs
Q6K_BYTES = 208  # a Q6_K block's bytes less d
Q4K_FILE_BYTES = 144  # a Q4_K block's bytes in the file: d, dmin, 12 of scales, 128 of nibbles
Q4K_OUTPUTS = 8  # outputs per q4k record
Q4K_NIBBLES = Q4K_OUTPUTS * K_INPUTS // 2  # a q4k record's q, then its 8 groups' scales and
Q4K_RECORD = Q4K_NIBBLES + 2 * 8 * Q4K_OUTPUTS  # minimums, a byte each per output (1152 in all)
Q4K_DS_BYTES = 2 * 2 * Q4K_OUTPUTS  # each record's float16 d and dmin, held after all records


def storage_bytes(shape: tuple[int, ...], fmt: str, itemsize: int) -> int:
    """Bytes a tensor of logical `shape` takes in format `fmt` (dense: `itemsize` each)."""
    count = math.prod(shape)
    if fmt == "dense":
        return count * itemsize
    out, inputs = shape
    if fmt in ROW_MATRIX_FORMATS:
        return out * sum(row_bytes(fmt, inputs))
    if fmt == "q4k":
        return out // Q4K_OUTPUTS * q4k_blocks_of(inputs) * (Q4K_RECORD + Q4K_DS_BYTES)
    return count // 2 + 4 * out * (inputs // GROUP)  # int4, int4rows: nibbles + scale, zero


def q4k_blocks_of(inputs: int) -> int:
    """A q4k matrix's blocks of K_INPUTS per 8 outputs: the last holds what is left over."""
    return -(-inputs // K_INPUTS)


def row_bytes(fmt: str, inputs: int) -> tuple[int, int]:
    """Bytes a row of a ROW_MATRIX_FORMATS matrix takes: (its values, its scales), the scales
    stored after all the rows' values."""
    if fmt == "int8":
        return inputs, 2
    blocks = inputs // K_INPUTS
    return blocks * Q6K_BYTES, blocks * 2


def check_quantizable(shape: tuple[int, ...], fmt: str) -> str | None:
    """Why a matrix of `shape` cannot take format `fmt`, or None if it can."""
    if fmt == "dense":
        return None
    if len(shape) != 2:
        return f"a {fmt} tensor is a matrix, not of shape {shape}"
    out, inputs = shape
    if fmt == "q6k" and inputs % K_INPUTS:
        return f"q6k needs inputs in blocks of {K_INPUTS}, not {inputs}"
    if fmt == "q4k" and (out % Q4K_OUTPUTS or inputs % GROUP):
        return f"q4k needs outputs in {Q4K_OUTPUTS}s and inputs in {GROUP}s, not {shape}"
    if fmt in ("int4", "int4rows") and inputs % GROUP:
        return f"{fmt} needs inputs in groups of {GROUP}, not {inputs}"
    if fmt == "int4" and (out % 16 or inputs % (16 * PACK_TILES)):
        return f"int4 packing needs outputs in 16s and inputs in {16 * PACK_TILES}s, not {shape}"
    return None


# our kernels' code for each matrix format (csrc/products.h's Format)
FORMAT_CODES = {"int4": 0, "int8": 1, "q6k": 2, "q4k": 3}
# a plain pre-norm layer's matrices in the order a whole layer's call takes them (csrc/layer.h)
LAYER_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
