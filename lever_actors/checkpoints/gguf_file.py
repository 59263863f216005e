"""Load a GGUF file (llama.cpp's format): model args, dequantized weights and tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from lever_actors.checkpoints.checkpoint import Checkpoint
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.errors import CheckpointError
from lever_actors.model.args import ModelArgs, RopeScaling, check_architecture
from lever_actors.model.weights import LayerTensors, ModelWeights, layer_tensor_names

# GGUF per-layer tensor name (after "blk.N.") -> our name.
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}
_MISSING: Any = object()
_CHUNK_BLOCKS = 2048


def load_gguf(path: Path, dtype: torch.dtype) -> Checkpoint:
    """Read a llama/qwen2/qwen3 GGUF file into DRAM, every tensor dequantized to `dtype`."""
    reader = _open(path)
    args = _read_args(reader, path)
    tensors = {t.name: t for t in reader.tensors}

    def load(name: str) -> torch.Tensor:
        if name not in tensors:
            raise CheckpointError(f"{path}: GGUF file lacks tensor {name!r}")
        return _tensor(tensors[name], path).to(dtype)

    if "rope_freqs.weight" in tensors:
        # llama.cpp stores llama3 RoPE scaling as precomputed frequency factors, not as parameters.
        raise CheckpointError(f"{path}: RoPE scaling stored as a rope_freqs tensor is unsupported")
    embed = load("token_embd.weight")
    layers = [_load_layer(args, i, tensors, load, path) for i in range(args.n_layers)]
    has_vocab = "tokenizer.ggml.model" in reader.fields
    tokenizer = Tokenizer.from_gguf(reader, path) if has_vocab else None
    return Checkpoint(
        args=args,
        weights=ModelWeights(
            embed=embed,
            final_norm=load("output_norm.weight"),
            lm_head=embed if args.tie_embeddings else load("output.weight"),
            layers=layers,
        ),
        tokenizer=tokenizer,
        source=path,
    )


def _open(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    try:
        return _CheckedReader(path)
    except CheckpointError:
        raise
    except (ValueError, IndexError, KeyError, OSError) as cause:
        # The reader raises plain errors on a truncated or corrupt header or tensor table.
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


def _meta(reader: gguf.GGUFReader, key: str, path: Path, default: Any = _MISSING) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise CheckpointError(f"{path}: GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def _read_args(reader: gguf.GGUFReader, path: Path) -> ModelArgs:
    arch = check_architecture(str(_meta(reader, "general.architecture", path)), str(path))

    def meta(key: str, default: Any = _MISSING) -> Any:
        return _meta(reader, f"{arch}.{key}", path, default)

    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise CheckpointError(f"{path}: GGUF file lacks tensor 'token_embd.weight'")
    d_model, n_heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    return ModelArgs(
        arch=arch,
        vocab_size=int(embed.shape[1]),  # GGUF lists the innermost dim first: [d_model, vocab]
        d_model=d_model,
        n_layers=int(meta("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(meta("attention.head_count_kv", n_heads)),
        head_dim=int(meta("attention.key_length", d_model // n_heads)),
        ffn_dim=int(meta("feed_forward_length")),
        norm_eps=_decimal(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=_decimal(meta("rope.freq_base", 10000.0)),
        max_seq_len=int(meta("context_length")),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        rope_scaling=_rope_scaling(meta("rope.scaling.type", "none"), meta, path),
    )


def _decimal(value: float) -> float:
    # GGUF stores float32: 1e-6 reads as 9.99999997e-07. Take the shortest decimal that rounds to
    # the same float32, so args equal those from the model's config.json.
    return float(str(np.float32(value)))


def _rope_scaling(kind: str, meta: Any, path: Path) -> RopeScaling | None:
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=_decimal(meta("rope.scaling.factor")))
    raise CheckpointError(
        f"{path}: unsupported rope.scaling.type {kind!r}; supported: none, linear"
    )


def _load_layer(
    args: ModelArgs,
    i: int,
    tensors: dict[str, Any],
    load: Callable[[str], torch.Tensor],
    path: Path,
) -> LayerTensors:
    layer = {
        ours: load(f"blk.{i}.{theirs}")
        for theirs, ours in _LAYER_NAMES.items()
        if f"blk.{i}.{theirs}" in tensors
    }
    missing = [name for name in layer_tensor_names(args) if name not in layer]
    if missing:
        raise CheckpointError(f"{path}: layer {i} lacks tensors for {missing}")
    if args.arch == "llama":
        # llama.cpp's converter permutes q/k rows for its rotary layout; undo it to get HF's rows.
        layer["wq"] = unpermute_qk(layer["wq"], args.n_heads)
        layer["wk"] = unpermute_qk(layer["wk"], args.n_kv_heads)
    return layer


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (per head, rows (half, i) were stored as (i, half)).

    w: [n_heads * head_dim, d_model] -> same shape, rows in HF order.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tensor(t: gguf.ReaderTensor, path: Path) -> torch.Tensor:
    """One GGUF tensor as a float tensor in torch order, e.g. [out_features, in_features]."""
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
    kind = t.tensor_type
    if kind in (QType.F32, QType.F16, QType.F64):
        return torch.from_numpy(np.array(t.data)).reshape(shape)  # np.array copies out of the mmap
    if kind == QType.BF16:
        return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(_dequantize(t, path)).reshape(shape)


def _dequantize(t: gguf.ReaderTensor, path: Path) -> np.ndarray:
    """A quantized tensor's values: [n_blocks, block_size] float32, via gguf's numpy kernels."""
    quant = getattr(gguf.quants, t.tensor_type.name, None)  # gguf names each class after its type
    if quant is None or not hasattr(quant, "dequantize_blocks"):
        raise CheckpointError(
            f"{path}: tensor {t.name!r} has unsupported type {t.tensor_type.name}; supported: "
            "F32, F16, BF16, F64 and the quantized types the gguf package dequantizes"
        )
    quant.init_grid()  # the IQ types decode through a lookup grid built on first use
    block_size, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    blocks = t.data.reshape(-1, type_size)
    out = np.empty((blocks.shape[0], block_size), dtype=np.float32)
    # Cache-sized chunks: 2-4x faster than gguf.quants.dequantize's loop over 16-row groups.
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        chunk = slice(start, start + _CHUNK_BLOCKS)
        out[chunk] = quant.dequantize_blocks(blocks[chunk])
    return out
