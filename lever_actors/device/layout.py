"""A flash layout's stored bytes as torch's weights: each dense tensor a view in its dtype,
each quantized one model/quantized.py's (device/manifest.py describes the layout)."""

from __future__ import annotations

import torch

from lever_actors.device.manifest import Manifest, TensorEntry
from lever_actors.model.quantized import QuantizedRows, QuantizedWeight
from lever_actors.model.weights import Weight

DTYPE_NAMES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def weight_of(entry: TensorEntry, raw: torch.Tensor) -> Weight:
    """The tensor (or quantized weight) these stored bytes of `entry` hold: views, no copy.
    raw: [nbytes] uint8"""
    if entry.format == "dense":
        return raw.view(DTYPE_NAMES[entry.dtype]).view(entry.shape)
    if entry.format == "int4rows":
        return QuantizedRows.from_bytes(raw, entry.shape)  # type: ignore[arg-type]
    return QuantizedWeight.from_bytes(raw, entry.format, entry.shape)  # type: ignore[arg-type]


def torch_dtype(manifest: Manifest) -> torch.dtype:
    """The dtype the layout's dense tensors are stored and computed in."""
    return DTYPE_NAMES[manifest.dtype]
