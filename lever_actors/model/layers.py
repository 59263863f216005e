"""One decoder layer as a pure function of its inputs, so weights can arrive per layer."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lever_actors.model import fused, native
from lever_actors.model.args import ModelArgs
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.masks import within_window
from lever_actors.model.placement import Placement
from lever_actors.model.quantized import QuantizedWeight
from lever_actors.model.rope import apply_rope
from lever_actors.model.row_blocks import linear
from lever_actors.model.shapes import HEAD_ROWS, HEAD_TEMP_BYTES, rows_per_chunk
from lever_actors.model.weights import LayerTensors, Weight, cuts_into_rows, dense, row_range

# one sequence's pending block in a pass: its KV cache and where its rows sit
Block = tuple[KVCache, Placement]

# Every reduction below gives a row the same result whatever rows and columns come with it
# (matrix products through row_blocks.linear; attention and norms on our row kernels in bf16,
# else in float64), so verifying a tree of n tokens computes each token exactly as one-token
# decoding does, in bf16 as in float64: that is what makes the output equal sequential greedy
# decoding.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim], normalised in float64 (a sum rounded at 1e-16 cannot move a bf16 or
    float32 rounding, however the kernel splits the row); bf16 on our kernel, which sums
    each row in order."""
    if native.normalizes(x, weight):
        return native.rms_norm(x, weight, eps)
    h = x.to(torch.float64)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    args: ModelArgs,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads, so that a row's result does not
    depend on how many rows or masked keys come with it: bf16 on our kernel (each row alone,
    in one fixed order), else in float64.
    q: [n_heads, n, hd]; keys/values: [n_kv_heads, T, hd]; mask: [n, T] (True: attend)."""
    n_heads, n, hd = q.shape
    scale = (args.query_scale or hd) ** -0.5
    if native.attends(q, keys):
        return native.attend(q, keys, values, mask, scale, args.attn_softcap).transpose(0, 1)
    n_kv = keys.shape[0]
    group = q.to(torch.float64).reshape(n_kv, n_heads // n_kv * n, hd)  # heads sharing a kv head
    scores = group @ keys.to(torch.float64).transpose(1, 2) * scale
    if args.attn_softcap is not None:
        scores = softcap(scores, args.attn_softcap)
    if mask is not None:
        scores = scores.view(n_kv, n_heads // n_kv, n, -1).masked_fill(~mask, float("-inf"))
    out = torch.softmax(scores.view(n_kv, n_heads // n_kv * n, -1), -1) @ values.to(torch.float64)
    return out.view(n_heads, n, hd).to(q.dtype)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Squash x smoothly into (-cap, cap)."""
    return torch.tanh(x / cap) * cap


def project_qkv(
    x: torch.Tensor, w: LayerTensors, args: ModelArgs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [n, d_model] -> q: [n, n_heads*hd], k and v: [n, n_kv_heads*hd]"""
    if args.fused_projections:
        kv = args.n_kv_heads * args.head_dim
        q, k, v = linear(x, w["wqkv"]).split([args.n_heads * args.head_dim, kv, kv], dim=-1)
        return q, k, v
    return (
        linear(x, w["wq"], _bias(w, "bq")),
        linear(x, w["wk"], _bias(w, "bk")),
        linear(x, w["wv"], _bias(w, "bv")),
    )


def _bias(w: LayerTensors, name: str) -> torch.Tensor | None:
    bias = w.get(name)
    return None if bias is None else dense(bias)


def attention(
    x: torch.Tensor,
    w: LayerTensors,
    args: ModelArgs,
    blocks: Sequence[Block],
    layer: int,
) -> torch.Tensor:
    """x: [n, d_model] normed, each block's rows in turn -> [n, d_model]. The projections
    take every row at once; each block's k/v go into its own cache where its placement
    says, and its queries see that cache alone (a block-diagonal mask over the batch)."""
    q, k, v = project_qkv(x, w, args)
    outs, lo = [], 0
    for cache, place in blocks:
        hi = lo + place.positions.shape[0]
        outs.append(_attend_block(q[lo:hi], k[lo:hi], v[lo:hi], w, args, cache, layer, place))
        lo = hi
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return linear(out, w["wo"])


def _attend_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: LayerTensors,
    args: ModelArgs,
    cache: KVCache,
    layer: int,
    place: Placement,
) -> torch.Tensor:
    """One block's q: [n, n_heads*hd], k and v: [n, n_kv_heads*hd] -> [n, n_heads*hd]"""
    n = q.shape[0]
    q = q.view(n, args.n_heads, args.head_dim).transpose(0, 1)
    k = k.view(n, args.n_kv_heads, args.head_dim).transpose(0, 1)
    v = v.view(n, args.n_kv_heads, args.head_dim).transpose(0, 1)
    if args.qk_norm:
        q = rms_norm(q, dense(w["q_norm"]), args.norm_eps)
        k = rms_norm(k, dense(w["k_norm"]), args.norm_eps)
    q, k = apply_rope(q, place.cos, place.sin), apply_rope(k, place.cos, place.sin)
    keys, values = cache.write(layer, k, v, place.offsets, place.span, place.positions)
    mask, window = place.mask, args.window(layer)
    if window is not None:
        mask = within_window(mask, place.positions, cache.positions[: keys.shape[1]], window)
    out = attend(q, keys, values, mask, args)  # [n_heads, n, hd]
    return out.transpose(0, 1).reshape(n, -1)


def feed_forward(x: torch.Tensor, w: LayerTensors, args: ModelArgs) -> torch.Tensor:
    """A gated MLP: SwiGLU, or Gemma's tanh-GELU gate. x: [n, d_model] normed -> the same"""
    if args.fused_projections:
        gate, up = linear(x, w["w_gate_up"]).chunk(2, dim=-1)
    else:
        gate, up = linear(x, w["w_gate"]), linear(x, w["w_up"])
    if args.gemma:
        gated = F.gelu(gate, approximate="tanh") * up
    elif native.gates(gate):
        gated = native.swiglu(gate, up)  # as our fused layer and the plain kernels round it
    else:
        gated = F.silu(gate) * up
    return linear(gated, w["w_down"])


def layer_forward(
    x: torch.Tensor,
    w: LayerTensors,
    args: ModelArgs,
    cache: KVCache,
    layer: int,
    place: Placement,
) -> torch.Tensor:
    """x: [n, d_model] residual stream of the n pending tokens -> the same after this layer."""
    if fused.takes(x, w, args, layer):  # the same ops in one call of our kernels
        return fused.layer_forward(x, w, args, cache, layer, place)
    return blocks_layer_forward(x, w, args, [(cache, place)], layer)


def blocks_layer_forward(
    x: torch.Tensor, w: LayerTensors, args: ModelArgs, blocks: Sequence[Block], layer: int
) -> torch.Tensor:
    """x: [n, d_model] pending rows of several sequences, each block's in turn (its cache
    and placement) -> the same after this layer."""
    eps = args.norm_eps
    h = attention(rms_norm(x, dense(w["attn_norm"]), eps), w, args, blocks, layer)
    if args.gemma:
        h = rms_norm(h, dense(w["post_attn_norm"]), eps)
    x = x + h
    h = feed_forward(rms_norm(x, dense(w["ffn_norm"]), eps), w, args)
    if args.gemma:
        h = rms_norm(h, dense(w["post_ffn_norm"]), eps)
    return x + h


def layers_forward(
    x: torch.Tensor,
    layers: list[LayerTensors],
    args: ModelArgs,
    cache: KVCache,
    first: int,
    place: Placement,
) -> torch.Tensor:
    """x: [n, d_model] -> the same after `layers`, the model's first, first + 1, ...; a block
    placed whole at offsets 0..n-1 (a prompt) goes through each layer `rows_per_chunk` rows
    at a time, in order, so that each chunk's attention sees the keys the earlier ones
    wrote. Row for row the same result (the kernels are row-invariant), with a chunk's
    temporaries the most a layer holds at once."""
    n = x.shape[0]
    rows = rows_per_chunk(args, cache.length + n)
    if n <= rows or place.offsets is not None:
        for offset, weights in enumerate(layers):
            x = layer_forward(x, weights, args, cache, first + offset, place)
        return x
    chunks = [(lo, min(lo + rows, n)) for lo in range(0, n, rows)]
    placements = [place.chunk(lo, hi) for lo, hi in chunks]
    for offset, weights in enumerate(layers):
        x = torch.cat(
            [
                layer_forward(x[lo:hi], weights, args, cache, first + offset, chunk)
                for (lo, hi), chunk in zip(chunks, placements, strict=True)
            ]
        )
    return x


def batch_layers_forward(
    xs: Sequence[torch.Tensor],
    layers: list[LayerTensors],
    args: ModelArgs,
    blocks: Sequence[Block],
    first: int,
) -> list[torch.Tensor]:
    """Several sequences' pending rows, xs[i]: [n_i, d_model] with blocks[i] (its own KV
    cache and placement) -> each the same after `layers`. Their rows go through each matrix
    product together, which reads a layer's weights once for all and gives each row what it
    alone would (the kernels are row-invariant, and our fused layer does the same ops);
    a batch whose temporaries would pass CHUNK_BYTES (a prompt among them) goes a sequence
    at a time, each as `layers_forward`."""
    sizes = [x.shape[0] for x in xs]
    keys = max(cache.length for cache, _ in blocks) + sum(sizes)
    # several sequences take the ops one by one, their products shared, even where our fused
    # layer (one cache) would take each alone: it would read and unpack every matrix once per
    # sequence (8 one-row sequences of the real target: 259 ms a pass against 116)
    if len(xs) == 1 or sum(sizes) > rows_per_chunk(args, keys):
        return [
            layers_forward(x, layers, args, cache, first, place)
            for x, (cache, place) in zip(xs, blocks, strict=True)
        ]
    x = torch.cat(list(xs))
    for offset, weights in enumerate(layers):
        x = blocks_layer_forward(x, weights, args, blocks, first + offset)
    return list(x.split(sizes))


def embedding(rows: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The embedding table's rows for the tokens [n, d_model] -> the residual stream's start
    (Gemma scales it by sqrt(d_model), rounded to the model's dtype as it was trained)."""
    if args.gemma:
        return rows * torch.tensor(args.d_model**0.5, dtype=rows.dtype)
    return rows


def output_logits(
    hidden: torch.Tensor, final_norm: torch.Tensor, lm_head: Weight, args: ModelArgs
) -> torch.Tensor:
    """Final norm + LM head (+ Gemma's soft cap). hidden: [n, d_model] -> [n, vocab]"""
    normed = rms_norm(hidden, final_norm, args.norm_eps)
    logits = normed.new_empty(len(normed), lm_head.shape[0])
    head_products(normed, lm_head, logits)
    return capped_logits(logits, args)


def head_products(normed: torch.Tensor, rows: Weight, out: torch.Tensor) -> None:
    """normed [n, d_model] times some whole HEAD_ROWS blocks of the LM head (all of it, or a
    streamed part), `head_block` rows at a time, into out [n, rows] (filled in place: a
    tree's logits are tens of MB). A 4-bit packed head, whose rows cannot be cut apart (it
    never streams), multiplies whole."""
    if not cuts_into_rows(rows):
        out.copy_(linear(normed, rows))
        return
    n, block = rows.shape[0], head_block(rows, len(normed))
    for lo in range(0, n, block):
        hi = min(lo + block, n)
        out[:, lo:hi] = linear(normed, row_range(rows, lo, hi))


def head_block(rows: torch.Tensor | QuantizedWeight, n: int) -> int:
    """The LM head's rows one product takes for n rows of x. Torch's dense products take
    HEAD_ROWS, which fixes their sums' order, so a streamed head gives the resident one's
    bits; ours compute each logit alone however the head is cut, so they take as many
    HEAD_ROWS blocks as HEAD_TEMP_BYTES of logits hold: the whole head for a chain's few
    rows (a call per 4,096 rows cost a one-row pass 2.7 ms more, a four-row one 7.8 ms)."""
    if isinstance(rows, QuantizedWeight) and rows.on_our_kernels(n):
        return max(1, HEAD_TEMP_BYTES // (2 * n * HEAD_ROWS)) * HEAD_ROWS
    return HEAD_ROWS


def capped_logits(logits: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The LM head's products with Gemma's final soft cap where the model has one."""
    return logits if args.final_softcap is None else softcap(logits, args.final_softcap)
