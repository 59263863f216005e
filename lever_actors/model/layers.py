"""One decoder layer as a pure function of its inputs, so weights can arrive per layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lever_actors.model.args import ModelArgs
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.placement import Placement
from lever_actors.model.rope import apply_rope
from lever_actors.model.weights import LayerTensors


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim]. Low-precision inputs are normalised in float32, float64 stays float64."""
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def attention(
    x: torch.Tensor,
    w: LayerTensors,
    args: ModelArgs,
    cache: KVCache,
    layer: int,
    place: Placement,
) -> torch.Tensor:
    """x: [n, d_model] normed -> [n, d_model]; k/v go into the cache where `place` says."""
    n = x.shape[0]
    q = F.linear(x, w["wq"], w.get("bq")).view(n, args.n_heads, args.head_dim).transpose(0, 1)
    k = F.linear(x, w["wk"], w.get("bk")).view(n, args.n_kv_heads, args.head_dim).transpose(0, 1)
    v = F.linear(x, w["wv"], w.get("bv")).view(n, args.n_kv_heads, args.head_dim).transpose(0, 1)
    if args.qk_norm:
        q = rms_norm(q, w["q_norm"], args.norm_eps)
        k = rms_norm(k, w["k_norm"], args.norm_eps)
    q, k = apply_rope(q, place.cos, place.sin), apply_rope(k, place.cos, place.sin)
    keys, values = cache.write(layer, k, v, place.offsets, place.span)
    # q: [n_heads, n, hd]; keys/values: [n_kv_heads, context+n, hd]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=place.mask,
        enable_gqa=True,
    )
    return F.linear(out[0].transpose(0, 1).reshape(n, -1), w["wo"])


def feed_forward(x: torch.Tensor, w: LayerTensors) -> torch.Tensor:
    """SwiGLU. x: [n, d_model] normed -> [n, d_model]"""
    return F.linear(F.silu(F.linear(x, w["w_gate"])) * F.linear(x, w["w_up"]), w["w_down"])


def layer_forward(
    x: torch.Tensor,
    w: LayerTensors,
    args: ModelArgs,
    cache: KVCache,
    layer: int,
    place: Placement,
) -> torch.Tensor:
    """x: [n, d_model] residual stream of the n pending tokens -> the same after this layer."""
    x = x + attention(rms_norm(x, w["attn_norm"], args.norm_eps), w, args, cache, layer, place)
    return x + feed_forward(rms_norm(x, w["ffn_norm"], args.norm_eps), w)


def output_logits(
    hidden: torch.Tensor, final_norm: torch.Tensor, lm_head: torch.Tensor, eps: float
) -> torch.Tensor:
    """Final norm + LM head. hidden: [n, d_model] -> [n, vocab]"""
    return F.linear(rms_norm(hidden, final_norm, eps), lm_head)
