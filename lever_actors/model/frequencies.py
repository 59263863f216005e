"""Rotary embedding's per-pair rotation speeds as the bf16 path on our kernels and the plain
kernels share them, without torch: each computed in float64 with the C library's pow and
rounded once to float32. torch's float32 pow (model/rope.py, which float64 models keep, as HF
computes them) differs from it in the last bit of a few pairs in ten, and the plain path has
no torch to ask; one computation in both keeps their tables the same bits."""

from __future__ import annotations

import math

import numpy as np

from lever_actors.model.args import ModelArgs


def shared_inverse_frequencies(args: ModelArgs) -> np.ndarray | None:
    """[head_dim // 2] float32, or None for llama3's scaling (model/rope.py's alone)."""
    scaling = args.rope_scaling
    if scaling is not None and scaling.kind == "llama3":
        return None
    hd = np.float32(args.head_dim)
    exponents = [np.float32(i) / hd for i in range(0, args.head_dim, 2)]  # float32, as torch
    inverse = np.array([1.0 / math.pow(args.rope_theta, float(e)) for e in exponents], np.float32)
    if scaling is None:
        return inverse
    if scaling.kind == "linear":
        return inverse / np.float32(scaling.factor)
    return inverse / np.array(scaling.factors, np.float32)
