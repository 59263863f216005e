"""Tiny checkpoints to break: a GGUF file written from ModelArgs with its metadata as a dict
that tests edit, an HF directory, a flash layout; and the check a successful load must pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import msgspec
import numpy as np
import torch
from gguf import GGUFValueType as V

from lever_actors.checkpoints.checkpoint import Checkpoint
from lever_actors.checkpoints.gguf_file import gguf_name
from lever_actors.model.args import ModelArgs, check_args
from lever_actors.model.shapes import expected_shapes, layer_tensor_names
from lever_actors.model.weights import stored_tensors
from lever_actors.testing.checkpoints import TINY_ARGS, write_tiny_checkpoint

# qwen2: q/k/v biases too; 4 query heads over 2 key/value heads, so head counts can disagree
ARGS = msgspec.structs.replace(
    TINY_ARGS, arch="qwen2", n_heads=4, n_kv_heads=2, head_dim=4, ffn_dim=24, max_seq_len=64
)
TOKENS = [*"abcdefghijklmnopqrstuvwxyz", "<|im_end|>"]

# key -> (value, GGUF type, element type of an array)
Metadata = dict[str, tuple[Any, V, V | None]]


def gguf_metadata(args: ModelArgs = ARGS) -> Metadata:
    """What llama.cpp's converter writes for `args`, with a small byte-level vocabulary."""
    a = args.arch
    return {
        "general.architecture": (a, V.STRING, None),
        f"{a}.block_count": (args.n_layers, V.UINT32, None),
        f"{a}.context_length": (args.max_seq_len, V.UINT32, None),
        f"{a}.embedding_length": (args.d_model, V.UINT32, None),
        f"{a}.feed_forward_length": (args.ffn_dim, V.UINT32, None),
        f"{a}.attention.head_count": (args.n_heads, V.UINT32, None),
        f"{a}.attention.head_count_kv": (args.n_kv_heads, V.UINT32, None),
        f"{a}.attention.key_length": (args.head_dim, V.UINT32, None),
        f"{a}.rope.freq_base": (args.rope_theta, V.FLOAT32, None),
        f"{a}.attention.layer_norm_rms_epsilon": (args.norm_eps, V.FLOAT32, None),
        "tokenizer.ggml.model": ("gpt2", V.STRING, None),
        "tokenizer.ggml.pre": ("qwen2", V.STRING, None),
        "tokenizer.ggml.tokens": (TOKENS, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": ([1] * (len(TOKENS) - 1) + [3], V.ARRAY, V.INT32),
        "tokenizer.ggml.eos_token_id": (len(TOKENS) - 1, V.UINT32, None),
    }


def gguf_tensors(args: ModelArgs = ARGS, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors of the shapes `args` implies, under their GGUF names."""
    rng = np.random.default_rng(seed)
    shapes = expected_shapes(args)
    return {
        gguf_name(ours, layer): rng.normal(0, 0.3, shapes[ours]).astype(np.float32)
        for ours, layer in stored_tensors(args)
    }


def write_gguf(path: Path, metadata: Metadata, tensors: dict[str, np.ndarray]) -> Path:
    writer = gguf.GGUFWriter(path, "unused")
    del writer.kv_data[0]["general.architecture"]  # the writer adds one; ours is in `metadata`
    for key, (value, kind, sub_type) in metadata.items():
        writer.add_key_value(key, value, kind, sub_type)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_hf(directory: Path, args: ModelArgs = ARGS) -> Path:
    """A float64 HF checkpoint: config.json and one model.safetensors."""
    return write_tiny_checkpoint(directory, args)


def edit_json(path: Path, edit: Any) -> None:
    """Apply `edit` (a function of the parsed value, changing it in place) to a JSON file."""
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def assert_consistent(checkpoint: Checkpoint) -> None:
    """What a load that raised nothing must give: args in range and every tensor of the
    shape they imply."""
    args = check_args(checkpoint.args, "loaded")
    shapes = expected_shapes(args)
    w = checkpoint.weights
    assert tuple(w.embed.shape) == shapes["embed"]
    assert tuple(w.final_norm.shape) == shapes["final_norm"]
    assert tuple(w.lm_head.shape) == shapes["embed"]
    assert len(w.layers) == args.n_layers
    for layer in w.layers:
        assert sorted(layer) == sorted(layer_tensor_names(args))
        assert all(tuple(t.shape) == shapes[name] for name, t in layer.items())
    assert all(t.dtype == torch.float64 for t in (w.embed, w.final_norm, w.lm_head))
