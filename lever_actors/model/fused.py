"""One decoder layer in one call of our kernels (csrc/layer.h) where they take all of it: the
same kernels and ops as model/layers.py's `layer_forward`, in the same order, so the same
bits, without a Python call per op (about 1.3 ms of a one-row draft forward's 10, Zen 4).

It takes a plain pre-norm layer (no Gemma norms, qk norm, sliding window or fused
projections) with bf16 rows and every matrix on our AVX2 kernels (and their AVX512-VNNI
build); AMX's int8 kernel takes its rows in another layout, so there layers stay in Python.
"""

from __future__ import annotations

from typing import cast

import torch

from lever_actors.model import native
from lever_actors.model.args import ModelArgs
from lever_actors.model.formats import FORMAT_CODES, LAYER_MATRICES
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.placement import Placement
from lever_actors.model.quantized import QuantizedWeight
from lever_actors.model.weights import LayerTensors


def takes(x: torch.Tensor, w: LayerTensors, args: ModelArgs, layer: int) -> bool:
    """Whether this layer runs in one call for the rows x [n, d_model]."""
    isa = native.in_use()
    if isa is None or isa.stem != "avx2" or x.dtype != torch.bfloat16:
        return False
    if args.gemma or args.qk_norm or args.fused_projections or args.window(layer) is not None:
        return False
    if args.head_dim % 8 or args.n_heads // args.n_kv_heads > native.ATTEND_GROUP:
        return False
    rows = x.shape[0]
    return all(
        isinstance(m := w[name], QuantizedWeight) and m.on_our_kernels(rows)
        for name in LAYER_MATRICES
    ) and all(t.dtype == torch.bfloat16 for name, t in w.items() if name not in LAYER_MATRICES)


def layer_forward(
    x: torch.Tensor, w: LayerTensors, args: ModelArgs, cache: KVCache, layer: int, place: Placement
) -> torch.Tensor:
    """x: [n, d_model] residual stream of the n pending tokens -> the same after this layer
    (where `takes` said so), its k and v in the cache where `place` says."""
    n = x.shape[0]
    span = place.span if place.span is not None else n
    cache.room_for(span)
    matrices = cast(
        list[QuantizedWeight], [w[name] for name in LAYER_MATRICES]
    )  # `takes` checked each
    return native.decoder_layer(
        x.contiguous(),
        [w["attn_norm"], w["ffn_norm"]],
        [t for m in matrices for t in (m.data, m.scales)],
        [FORMAT_CODES[m.fmt] for m in matrices],
        [w.get("bq"), w.get("bk"), w.get("bv")],
        (cache.keys, cache.values, cache.positions),
        (layer, cache.length, span),
        place,
        (args.n_heads, args.head_dim, args.norm_eps, (args.query_scale or args.head_dim) ** -0.5),
        args.attn_softcap or 0.0,
    )
