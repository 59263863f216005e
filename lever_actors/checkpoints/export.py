"""Write any checkpoint we read (GGUF, flash layout, HF) as an HF safetensors directory.

The result is what `transformers.AutoModelForCausalLM.from_pretrained` and our own
`load_hf` read: config.json in the transformers format, model.safetensors (or shards plus
model.safetensors.index.json), and the tokenizer files when the source has a tokenizer.
Tensor names are the inverse of the mapping in checkpoints/hf.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lever_actors.checkpoints.checkpoint import Checkpoint
from lever_actors.checkpoints.hf import hf_name
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.checkpoints.new_directory import new_directory
from lever_actors.device.layout import DTYPE_NAMES
from lever_actors.errors import CheckpointError
from lever_actors.model.args import ModelArgs
from lever_actors.model.quantized import dense_values
from lever_actors.model.shapes import is_norm
from lever_actors.model.weights import stored, stored_tensors
from lever_actors.progress import Progress

DEFAULT_SHARD_BYTES = 2 * 10**9  # one model.safetensors up to this size, shards above it
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def export_hf(
    src: str | Path,
    out: Path,
    dtype: torch.dtype,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: Progress | None = None,
) -> Path:
    """Write the HF directory of checkpoint `src` to `out` (which must not exist), as `dtype`.

    Written under a temporary name beside `out` and renamed at the end, so an interrupted
    export leaves nothing that loads.
    """
    if dtype not in DTYPE_NAMES.values():
        raise CheckpointError(
            f"cannot export weights as {dtype}; choose one of {list(DTYPE_NAMES)}"
        )
    with new_directory(out) as tmp:
        checkpoint = load_checkpoint(src, dtype)
        write_hf(checkpoint, tmp, dtype, shard_bytes=shard_bytes, progress=progress)
    return out


def write_hf(
    checkpoint: Checkpoint,
    directory: Path,
    dtype: torch.dtype,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: Progress | None = None,
) -> None:
    """Write a loaded checkpoint's HF files into an existing, empty `directory`."""
    tensors = [(name, t.to(dtype).contiguous()) for name, t in hf_tensors(checkpoint)]
    _write_safetensors(tensors, directory, shard_bytes, progress)
    tokenizer = checkpoint.tokenizer
    if tokenizer is not None:
        tokenizer.save(directory)
        # transformers' AutoTokenizer wants a class name; ours ignores extra keys
        _merge_json(
            directory / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"}
        )
        if tokenizer.bos_id is not None:
            _merge_json(directory / "generation_config.json", {"bos_token_id": tokenizer.bos_id})
    config = hf_config(checkpoint.args, dtype)
    if tokenizer is not None:
        eos = sorted(tokenizer.eos_ids)
        config["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        config["bos_token_id"] = tokenizer.bos_id
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _fsync_dir(directory)


def hf_tensors(checkpoint: Checkpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) in file order: embedding, layers, final norm, LM head unless tied."""
    w, args = checkpoint.weights, checkpoint.args
    for ours, layer in stored_tensors(args):
        tensor = dense_values(stored(getattr(w, ours) if layer is None else w.layers[layer][ours]))
        if is_norm(ours) and args.norm_offset:
            tensor = tensor.to(torch.float64) - args.norm_offset  # HF stores w of (1 + w)
        yield hf_name(ours, layer, args), tensor


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for transformers: both the >= 5 `rope_parameters` and the older flat
    `rope_theta` / `rope_scaling`, so that either generation of the library reads it."""
    dtype_name = next(name for name, d in DTYPE_NAMES.items() if d == dtype)
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    rope_scaling: dict[str, Any] | None = None
    if args.rope_scaling is not None and args.rope_scaling.kind == "freq_factors":
        raise CheckpointError(
            "RoPE frequency factors (a GGUF's rope_freqs) have no HF config.json spelling"
        )
    if args.rope_scaling is not None:
        s = args.rope_scaling
        rope_scaling = {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            rope_scaling |= {
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        rope_parameters = {**rope_scaling, "rope_theta": args.rope_theta}
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[args.arch]],
        "model_type": args.arch,
        "vocab_size": args.vocab_size,
        "hidden_size": args.d_model,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "gelu_pytorch_tanh" if args.gemma else "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": args.tie_embeddings,
        "torch_dtype": dtype_name,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if args.arch in ("llama", "qwen3"):
        config["attention_bias"] = False  # qwen2's q/k/v biases are implied by its type
    if args.arch == "llama":
        config["mlp_bias"] = False
    return config | _attention_config(args)


def _attention_config(args: ModelArgs) -> dict[str, Any]:
    """The keys that say which layers attend within a window, and Gemma 2's attention."""
    layer_types = [
        "sliding_attention" if args.window(i) else "full_attention" for i in range(args.n_layers)
    ]
    if args.arch == "gemma2":
        return {
            "sliding_window": args.sliding_window,
            "layer_types": layer_types,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": args.query_scale or args.head_dim,
            "attn_logit_softcapping": args.attn_softcap,
            "final_logit_softcapping": args.final_softcap,
        }
    if args.arch == "qwen2":
        # Qwen2's window covers the layers from max_window_layers on
        first = min(args.sliding_layers, default=args.n_layers)
        return {
            "use_sliding_window": bool(args.sliding_layers),
            "sliding_window": args.sliding_window,
            "max_window_layers": first,
            "layer_types": layer_types,
        }
    if args.arch in ("mistral", "phi3"):
        return {"sliding_window": args.sliding_window}  # every layer or none
    if args.arch == "qwen3":
        return {"use_sliding_window": False, "sliding_window": None}
    return {}


def _write_safetensors(
    tensors: list[tuple[str, torch.Tensor]],
    directory: Path,
    shard_bytes: int,
    progress: Progress | None,
) -> None:
    total = sum(_nbytes(t) for _, t in tensors)
    shards = _plan_shards(tensors, shard_bytes) if total > shard_bytes else [tensors]
    names = (
        [SINGLE_NAME]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    done = 0
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        path = directory / name
        save_file(dict(shard), str(path), metadata={"format": "pt"})
        _fsync(path)
        for tensor_name, tensor in shard:
            weight_map[tensor_name] = name
            done += _nbytes(tensor)
        if progress:
            progress(done, total, f"export {name}")
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _plan_shards(
    tensors: list[tuple[str, torch.Tensor]], shard_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors into shards of at most `shard_bytes` (a bigger tensor alone)."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in tensors:
        if shards[-1] and size + _nbytes(tensor) > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += _nbytes(tensor)
    return shards


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _merge_json(path: Path, values: dict[str, Any]) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**data, **values}, ensure_ascii=False))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            _fsync(path)
