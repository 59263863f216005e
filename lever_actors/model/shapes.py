"""The tensors a model's args imply, by our names, and their shapes, without torch: what
every reader of weights (HF, GGUF, a flash layout) checks against; and the sizes a pass and
its KV cache take, which the plans count."""

from __future__ import annotations

from lever_actors.model.args import ModelArgs


def layer_tensor_names(args: ModelArgs) -> tuple[str, ...]:
    """Names (and so the flash-layout order) of one layer's tensors for this architecture."""
    if args.fused_projections:
        return ("attn_norm", "wqkv", "wo", "ffn_norm", "w_gate_up", "w_down")
    names = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down"]
    if args.gemma:
        names += ["post_attn_norm", "post_ffn_norm"]
    if args.qkv_bias:
        names += ["bq", "bk", "bv"]
    if args.qk_norm:
        names += ["q_norm", "k_norm"]
    return tuple(names)


def is_norm(name: str) -> bool:
    """Whether our tensor `name` is a norm's weight (a vector that multiplies, near 1)."""
    return name.endswith("norm")


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The torch-order shape `args` implies for every stored tensor, by our name: the globals
    (the LM head only when not tied to the embedding) and one layer's tensors, the same in
    every layer. The HF, GGUF and flash-layout readers all check their tensors against it."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    layer = {
        "attn_norm": (args.d_model,),
        "wq": (q, args.d_model),
        "wk": (kv, args.d_model),
        "wv": (kv, args.d_model),
        "wo": (args.d_model, q),
        "ffn_norm": (args.d_model,),
        "w_gate": (args.ffn_dim, args.d_model),
        "w_up": (args.ffn_dim, args.d_model),
        "w_down": (args.d_model, args.ffn_dim),
        "wqkv": (q + 2 * kv, args.d_model),  # rows: q, then k, then v
        "w_gate_up": (2 * args.ffn_dim, args.d_model),  # rows: gate, then up
        "post_attn_norm": (args.d_model,),
        "post_ffn_norm": (args.d_model,),
        "bq": (q,),
        "bk": (kv,),
        "bv": (kv,),
        "q_norm": (args.head_dim,),
        "k_norm": (args.head_dim,),
    }
    shapes = {"embed": (args.vocab_size, args.d_model), "final_norm": (args.d_model,)}
    if not args.tie_embeddings:
        shapes["lm_head"] = (args.vocab_size, args.d_model)
    return shapes | {name: layer[name] for name in layer_tensor_names(args)}


# A layer runs a long block (a prompt) this many bytes of temporaries at a time: its MLP's
# hidden activations and one attention score per head and key for a chunk of rows. A
# 1,500-token prompt whole held about 270 MB of them per layer, past a 1 GiB limit.
CHUNK_BYTES = 32 << 20


# The LM head streams from flash in whole blocks of this many vocabulary rows, and torch's
# dense products take it block by block, resident or streamed alike, so both give the same
# logits bit for bit (ours sum each logit alone: model/layers.py, head_block).
HEAD_ROWS = 4096
# where a head's blocks may be larger (model/layers.py: head_block), one product's logits
# take at most this many bytes (bf16) beside the whole pass's
HEAD_TEMP_BYTES = 8 << 20


def rows_per_chunk(args: ModelArgs, keys: int) -> int:
    """Rows of a block whose temporaries in one layer stay within CHUNK_BYTES (float32 each),
    when attention sees `keys` positions; at least one."""
    per_row = 4 * (3 * args.ffn_dim + args.n_heads * keys)
    return max(1, CHUNK_BYTES // per_row)


def position_bytes(args: ModelArgs, itemsize: int) -> int:
    """What a KV cache holds per position: keys and values of every layer, in elements of
    `itemsize` bytes, and the position (int64)."""
    return args.n_layers * 2 * args.n_kv_heads * args.head_dim * itemsize + 8
