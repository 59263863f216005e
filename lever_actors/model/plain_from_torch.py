"""Weights held as torch tensors (a Transformer's, a FlashTarget's resident ones) as the plain
path takes them (model/plain_model.py), sharing their memory: how the tests and the bench
compare the plain path with torch's on the same bytes until the plain path reads a layout
itself."""

from __future__ import annotations

import numpy as np
import torch

from lever_actors.model import plain
from lever_actors.model.formats import LAYER_MATRICES
from lever_actors.model.plain_model import DenseRows, Int4Rows, Weights
from lever_actors.model.quantized import QuantizedRows, QuantizedWeight
from lever_actors.model.weights import LayerTensors, Weight, dense


def bits(t: torch.Tensor) -> np.ndarray:
    """A bf16 or float16 tensor's elements as numpy uint16 bits, sharing its memory."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def matrix(q: Weight) -> plain.Matrix:
    if not isinstance(q, QuantizedWeight):
        raise TypeError(f"the plain path multiplies quantized matrices, not {type(q).__name__}")
    return plain.Matrix(q.fmt, q.shape, q.data.numpy(), bits(q.scales))  # scales: 16-bit


def layer(w: LayerTensors) -> plain.Layer:
    bq, bk, bv = (bits(dense(w[name])) if name in w else None for name in ("bq", "bk", "bv"))
    return plain.Layer(
        bits(dense(w["attn_norm"])),
        bits(dense(w["ffn_norm"])),
        tuple(matrix(w[name]) for name in LAYER_MATRICES),
        bq,
        bk,
        bv,
    )


def embedding(table: Weight) -> DenseRows | Int4Rows:
    if isinstance(table, QuantizedRows):
        return Int4Rows(table.records.numpy(), table.shape[1])
    if isinstance(table, torch.Tensor) and table.dtype == torch.bfloat16:
        return DenseRows(bits(table))
    raise TypeError(f"the plain path embeds from bf16 or int4rows, not {table}")


def weights(
    embed: Weight, layers: list[LayerTensors], final_norm: torch.Tensor, lm_head: Weight
) -> Weights:
    return Weights(embedding(embed), [layer(w) for w in layers], bits(final_norm), matrix(lm_head))
