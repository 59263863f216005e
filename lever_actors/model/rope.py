"""Rotary position embedding, with the 'linear', 'llama3' and per-pair 'freq_factors' scalings.

Angles are computed in float32 whatever the model dtype: that is the convention the
checkpoints were trained and published with, so every dtype sees the same rotation.
"""

from __future__ import annotations

import math

import torch

from lever_actors.model import native
from lever_actors.model.args import ModelArgs, RopeScaling
from lever_actors.model.frequencies import shared_inverse_frequencies


def inverse_frequencies(args: ModelArgs) -> torch.Tensor:
    """Per-pair rotation speeds. -> [head_dim // 2] float32"""
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.int64).float() / args.head_dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    if args.rope_scaling is None:
        return inv_freq
    if args.rope_scaling.kind == "linear":
        return inv_freq / args.rope_scaling.factor
    if args.rope_scaling.kind == "freq_factors":
        return inv_freq / torch.tensor(args.rope_scaling.factors, dtype=torch.float32)
    return _llama3_scaled(inv_freq, args.rope_scaling)


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rope:
    """Turns positions into the cos/sin tables one layer's attention needs."""

    def __init__(self, args: ModelArgs) -> None:
        self.inv_freq = inverse_frequencies(args)
        shared = shared_inverse_frequencies(args)
        self.shared_inv_freq = None if shared is None else torch.from_numpy(shared)

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [n] int64 -> cos, sin: [n, head_dim] in `dtype`. bf16 on our kernels
        from the speeds the plain kernels share (model/frequencies.py), as they compute them."""
        if dtype == torch.bfloat16 and self.shared_inv_freq is not None and native.in_use():
            return native.rope_tables(positions, self.shared_inv_freq)
        angles = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, n, head_dim]; rotates each half-split pair (the HF weight layout). bf16 on our
    kernel, one call for these ten small ops, rounded as they round."""
    if native.rotates(x, cos):
        return native.rope(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
