"""Load a GGUF file (llama.cpp's format): model args, dequantized weights and tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import msgspec
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType

from lever_actors.checkpoints.checkpoint import Checkpoint, check_layer_count
from lever_actors.checkpoints.gguf_tokenizer import tokenizer_from_gguf
from lever_actors.checkpoints.quantize import (
    ROW_WISE_FORMATS,
    check_choice,
    copies_embedding,
    q4k_to_int4,
    quantize_by_rows,
    quantize_tensor,
    tensor_format,
    tied_head,
)
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.config import Weights
from lever_actors.device.memory import return_freed_heap
from lever_actors.errors import CheckpointError
from lever_actors.model.args import ModelArgs, RopeScaling, check_args
from lever_actors.model.quantized import from_q4k_blocks, from_q6k_blocks
from lever_actors.model.shapes import expected_shapes, layer_tensor_names
from lever_actors.model.weights import ModelWeights, Weight, dense, stored_tensors

# our per-layer tensor name -> GGUF's (after "blk.N.")
_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
    "post_attn_norm": "post_attention_norm.weight",  # Gemma 2
    "post_ffn_norm": "post_ffw_norm.weight",
    "wqkv": "attn_qkv.weight",  # Phi-3's fused projections
    "w_gate_up": "ffn_up.weight",
}
# llama.cpp's architecture names we read (it converts Mistral, SmolLM and TinyLlama to llama)
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "phi3")
_SWA_LAYERS = {"gemma2": 2, "phi3": 1}  # every n-th layer from layer 0 attends within the window
_GLOBAL_NAMES = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}
# ModelArgs field -> its metadata key after "<arch>."
_META_KEYS = {
    "n_layers": "block_count",
    "d_model": "embedding_length",
    "n_heads": "attention.head_count",
    "n_kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "ffn_dim": "feed_forward_length",
    "norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "max_seq_len": "context_length",
    "rope_scaling.factor": "rope.scaling.factor",
    "sliding_window": "attention.sliding_window",
    "attn_softcap": "attn_logit_softcapping",
    "final_softcap": "final_logit_softcapping",
    "rope_dims": "rope.dimension_count",
}
_ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE scaling, stored as per-pair frequency divisors
_UNSUPPORTED_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # LongRoPE
# What gguf's reader and numpy raise on a corrupt header, metadata value or tensor table.
_READER_ERRORS = (ValueError, TypeError, IndexError, KeyError, OverflowError, RecursionError)
_MISSING: Any = object()
_CHUNK_BLOCKS = 2048
_CHUNK_VALUES = 1 << 22  # a row-wise quantized matrix is read in chunks of 16 MB of float32


def load_gguf(path: Path, dtype: torch.dtype, weights: Weights = "dense") -> Checkpoint:
    """Read a GGUF file of one of GGUF_ARCHITECTURES into DRAM, after checking its metadata
    and every tensor's shape against what the metadata implies: every tensor dequantized to
    `dtype`, or with `weights` other than "dense", matrices kept quantized (checkpoints/
    quantize.py; `dtype` must then be bfloat16)."""
    weights = check_choice(weights, dtype)
    reader = _open(path)
    tensors = {t.name: t for t in reader.tensors}
    for name in _UNSUPPORTED_TENSORS:
        if name in tensors:
            raise CheckpointError(f"{path}: LongRoPE scaling ({name}) is unsupported")
    args = _read_args(reader, tensors, path)
    _check_tensors(args, tensors, path)
    tokenizer = _tokenizer(reader, path)
    # the metadata is read: drop it before the weights come, since gguf keeps several
    # numpy views per vocabulary entry (about 220 MB for 151k tokens and their merges)
    reader.fields.clear()

    def load(ours: str, layer: int | None = None, stored_as: str | None = None) -> Weight:
        weight = _load(ours, layer, stored_as)
        return_freed_heap()  # its temporaries, before they pile up behind the weights kept
        return weight

    def _load(ours: str, layer: int | None, stored_as: str | None) -> Weight:
        t = tensors[gguf_name(stored_as or ours, layer)]
        shape = _torch_shape(t)
        fmt = tensor_format(weights, ours, shape, t.tensor_type.name)
        heads = _permuted_heads(args, ours)
        kept = {"q6k": QType.Q6_K, "q4k": QType.Q4_K}.get(fmt) == t.tensor_type
        if kept or (fmt in ("int4", "int4rows") and t.tensor_type == QType.Q4_K):
            assert len(shape) == 2  # tensor_format quantizes matrices only
            rows = torch.from_numpy(np.array(t.data)).view(shape[0], -1)  # a row's blocks
            rows = rows if heads is None else unpermute_qk(rows, heads)
            if kept:
                return (from_q6k_blocks if fmt == "q6k" else from_q4k_blocks)(rows, shape)
            return q4k_to_int4(rows, shape, fmt)
        if fmt in ROW_WISE_FORMATS and heads is None:
            assert len(shape) == 2  # as above
            return quantize_by_rows(_row_chunks(t, path), fmt, shape)
        values = _tensor(t, path)
        values = values if heads is None else unpermute_qk(values, heads)
        return quantize_tensor(values, fmt, dtype)

    embed = load("embed")
    tied = args.tie_embeddings
    if tied:
        args, lm_head = tied_head(args, embed, lambda: load("lm_head", stored_as="embed"))
    else:
        lm_head = load("lm_head")
    return Checkpoint(
        args=args,
        weights=ModelWeights(
            embed=embed,
            final_norm=dense(load("final_norm")),
            lm_head=lm_head,
            layers=[
                {name: load(name, i) for name in layer_tensor_names(args)}
                for i in range(args.n_layers)
            ],
            head_copies_embed=lm_head is not embed and (tied or copies_embedding(embed, lm_head)),
        ),
        tokenizer=tokenizer,
        source=path,
    )


def gguf_name(ours: str, layer: int | None) -> str:
    """GGUF's name for our tensor `ours` of `layer` (None for the embedding, norm and head)."""
    return _GLOBAL_NAMES[ours] if layer is None else f"blk.{layer}.{_LAYER_NAMES[ours]}"


def _open(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    try:
        return _CheckedReader(path)
    except CheckpointError:
        raise
    except (*_READER_ERRORS, OSError) as cause:
        raise CheckpointError(
            f"{path}: cannot read GGUF file ({path.stat().st_size} bytes; truncated or corrupt?): "
            f"{type(cause).__name__}: {cause}"
        ) from cause


class _CheckedReader(gguf.GGUFReader):
    """A GGUFReader that names the tensor whose type is unknown or whose data is cut off."""

    def __init__(self, path: Path) -> None:
        self._path = path
        super().__init__(path)

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._bytes

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        # A plain ndarray view of the np.memmap: slicing it skips memmap's per-slice overhead,
        # which made reading the 300k vocabulary strings and dequantizing ~2x slower.
        self._bytes = np.asarray(mapped)

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        for field in fields:
            _, name_bytes, _, dims, raw_type, offset = field.parts  # gguf's tensor-info layout
            name = bytes(name_bytes).decode("utf-8", "replace")
            try:
                kind = QType(int(raw_type[0]))
            except ValueError:
                raise CheckpointError(
                    f"{self._path}: tensor {name!r} has unknown GGML type id {int(raw_type[0])}"
                ) from None
            block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
            end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block_size
            if end > len(self.data):
                raise CheckpointError(
                    f"{self._path}: tensor {name!r} runs past the end of the file (truncated?): "
                    f"its data ends at byte {end}, the file has {len(self.data)}"
                )
        super()._build_tensors(start_offs, fields)


def _meta(
    reader: gguf.GGUFReader, key: str, kind: type, path: Path, default: Any = _MISSING
) -> Any:
    """Metadata value `key` as a `kind` (int, float or str); float32 values as their shortest
    decimal."""
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise CheckpointError(f"{path}: GGUF metadata lacks {key!r}")
        return default
    try:
        value: Any = msgspec.convert(field.contents(), kind)  # a `kind`, known at run time
    except (msgspec.ValidationError, *_READER_ERRORS) as cause:
        raise CheckpointError(
            f"{path}: GGUF metadata {key!r} is unreadable as {kind.__name__} "
            f"({type(cause).__name__}: {cause})"
        ) from None
    return _decimal(value) if field.types == [GGUFValueType.FLOAT32] else value


def _read_args(reader: gguf.GGUFReader, tensors: dict[str, Any], path: Path) -> ModelArgs:
    arch = _meta(reader, "general.architecture", str, path)
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: unsupported general.architecture {arch!r}; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def meta(ours: str, kind: type, default: Any = _MISSING) -> Any:
        return _meta(reader, f"{arch}.{_META_KEYS[ours]}", kind, path, default)

    d_model, n_heads, n_layers = meta("d_model", int), meta("n_heads", int), meta("n_layers", int)
    # a zero head count is reported by check_args, not divided by here
    head_dim = meta("head_dim", int, d_model // n_heads if n_heads > 0 else 0)
    if meta("rope_dims", int, head_dim) != head_dim:
        raise CheckpointError(
            f"{path}: {arch}.rope.dimension_count = {meta('rope_dims', int)} is unsupported: "
            f"RoPE over part of a head (head_dim {head_dim})"
        )
    window = meta("sliding_window", int, None) if arch in _SWA_LAYERS else None
    args = ModelArgs(
        arch=arch,
        vocab_size=_vocab_size(tensors, path),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=meta("n_kv_heads", int, n_heads),
        head_dim=head_dim,
        ffn_dim=meta("ffn_dim", int),
        norm_eps=meta("norm_eps", float),
        rope_theta=meta("rope_theta", float, 10000.0),
        max_seq_len=meta("max_seq_len", int),
        tie_embeddings=_GLOBAL_NAMES["lm_head"] not in tensors,
        rope_scaling=_rope_scaling(
            _meta(reader, f"{arch}.rope.scaling.type", str, path, "none"), meta, tensors, path
        ),
        sliding_window=window,
        sliding_layers=() if window is None else tuple(range(0, n_layers, _SWA_LAYERS[arch])),
        **(_gemma2_args(meta, d_model, n_heads, n_layers, head_dim) if arch == "gemma2" else {}),
    )
    names = {ours: f"{arch}.{key}" for ours, key in _META_KEYS.items()}
    names |= {"vocab_size": "token_embd.weight's vocabulary", "rope_scaling.factors": _ROPE_FREQS}
    return check_args(args, str(path), names)


def _vocab_size(tensors: dict[str, Any], path: Path) -> int:
    embed = tensors.get(_GLOBAL_NAMES["embed"])
    if embed is None:
        raise CheckpointError(f"{path}: GGUF file lacks tensor {_GLOBAL_NAMES['embed']!r}")
    shape = _torch_shape(embed)
    if len(shape) != 2:
        raise CheckpointError(f"{path}: tensor {embed.name!r} has shape {shape}, not 2-D")
    return shape[0]


def _torch_shape(t: gguf.ReaderTensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists dims innermost first


def _decimal(value: float) -> float:
    # GGUF stores float32: 1e-6 reads as 9.99999997e-07. Take the shortest decimal that rounds to
    # the same float32, so args equal those from the model's config.json.
    return float(str(np.float32(value)))


def _gemma2_args(
    meta: Callable[..., Any], d_model: int, n_heads: int, n_layers: int, head_dim: int
) -> dict[str, Any]:
    """Gemma 2's soft caps, and its query scale, which GGUF does not store: llama.cpp takes
    head_dim, but d_model / n_heads for the 46-layer 27B model, as Google's config does."""
    return {
        "attn_softcap": meta("attn_softcap", float, None),
        "final_softcap": meta("final_softcap", float, None),
        "query_scale": float(d_model // n_heads if n_layers == 46 else head_dim),
    }


def _rope_scaling(kind: str, meta: Any, tensors: dict[str, Any], path: Path) -> RopeScaling | None:
    if _ROPE_FREQS in tensors:
        factors = _tensor(tensors[_ROPE_FREQS], path).flatten().tolist()
        return RopeScaling(kind="freq_factors", factors=tuple(factors))
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=meta("rope_scaling.factor", float))
    raise CheckpointError(
        f"{path}: unsupported rope.scaling.type {kind!r}; supported: none, linear"
    )


def _check_tensors(args: ModelArgs, tensors: dict[str, Any], path: Path) -> None:
    """Every tensor the model needs is there with the shape the metadata implies (checked on
    the header, before any data is read), and no block lies past block_count."""
    expected = expected_shapes(args)
    for ours, layer in stored_tensors(args):
        name = gguf_name(ours, layer)
        if name not in tensors:
            raise CheckpointError(f"{path}: GGUF file lacks tensor {name!r}")
        shape = _torch_shape(tensors[name])
        if shape != expected[ours]:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {shape}, the metadata implies {expected[ours]}"
            )
    check_layer_count(tensors, ("blk",), args.n_layers, f"{path}: {args.arch}.block_count")


def _tokenizer(reader: gguf.GGUFReader, path: Path) -> Tokenizer | None:
    if "tokenizer.ggml.model" not in reader.fields:
        return None
    try:
        tokenizer = tokenizer_from_gguf(reader, path)
    except CheckpointError:
        raise
    except (*_READER_ERRORS, AttributeError) as cause:
        # tokenizer metadata of the wrong type or out of range
        raise CheckpointError(
            f"{path}: cannot build the tokenizer from its metadata: {type(cause).__name__}: {cause}"
        ) from cause
    _check_token_ids(tokenizer, path)
    return tokenizer


def _check_token_ids(tokenizer: Tokenizer, path: Path) -> None:
    """The ids the tokenizer starts or stops on are among its tokens."""
    for special in (*tokenizer.eos_ids, tokenizer.bos_id):
        in_range = isinstance(special, int) and 0 <= special < tokenizer.vocab_size
        if special is not None and not in_range:
            raise CheckpointError(
                f"{path}: special token id {special!r} is not one of the "
                f"{tokenizer.vocab_size} tokens"
            )


def _permuted_heads(args: ModelArgs, ours: str) -> int | None:
    """The head count whose rows llama.cpp's converter permuted in tensor `ours` (llama's q
    and k, for its rotary layout; Mistral, SmolLM and TinyLlama are llama), else None."""
    if args.arch != "llama":
        return None
    return {"wq": args.n_heads, "wk": args.n_kv_heads}.get(ours)


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (per head, rows (half, i) were stored as (i, half)).

    w: [n_heads * head_dim, ...] -> same shape, rows in HF order.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tensor(t: gguf.ReaderTensor, path: Path) -> torch.Tensor:
    """One GGUF tensor as a float tensor in torch order, e.g. [out_features, in_features]."""
    shape = _torch_shape(t)
    kind = t.tensor_type
    if kind in (QType.F32, QType.F16, QType.F64):
        return torch.from_numpy(np.array(t.data)).reshape(shape)  # np.array copies out of the mmap
    if kind == QType.BF16:
        return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(_dequantize(t, path)).reshape(shape)


def _row_chunks(t: gguf.ReaderTensor, path: Path) -> Iterator[torch.Tensor]:
    """A 2-D quantized tensor's values, [rows, in] float32 a few MB at a time."""
    out, inputs = _torch_shape(t)
    if t.tensor_type in (QType.F32, QType.F16, QType.F64, QType.BF16):
        yield _tensor(t, path).float()
        return
    block_size, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    per_row = inputs // block_size
    blocks = t.data.reshape(-1, type_size)
    rows = max(1, _CHUNK_VALUES // inputs)
    for start in range(0, out, rows):
        chunk = blocks[start * per_row : min(start + rows, out) * per_row]
        yield torch.from_numpy(_dequantize_blocks(t, chunk, path)).reshape(-1, inputs)


def _dequantize(t: gguf.ReaderTensor, path: Path) -> np.ndarray:
    """A quantized tensor's values: [n_blocks, block_size] float32, via gguf's numpy kernels."""
    _, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    return _dequantize_blocks(t, t.data.reshape(-1, type_size), path)


def _dequantize_blocks(t: gguf.ReaderTensor, blocks: np.ndarray, path: Path) -> np.ndarray:
    """Some of tensor t's blocks, [n, type_size] bytes -> their values [n, block_size]."""
    quant = getattr(gguf.quants, t.tensor_type.name, None)  # gguf names each class after its type
    if quant is None or not hasattr(quant, "dequantize_blocks"):
        raise CheckpointError(
            f"{path}: tensor {t.name!r} has unsupported type {t.tensor_type.name}; supported: "
            "F32, F16, BF16, F64 and the quantized types the gguf package dequantizes"
        )
    quant.init_grid()  # the IQ types decode through a lookup grid built on first use
    block_size, _ = gguf.GGML_QUANT_SIZES[t.tensor_type]
    out = np.empty((blocks.shape[0], block_size), dtype=np.float32)
    # Cache-sized chunks: 2-4x faster than gguf.quants.dequantize's loop over 16-row groups.
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        chunk = slice(start, start + _CHUNK_BLOCKS)
        out[chunk] = quant.dequantize_blocks(blocks[chunk])
    return out
