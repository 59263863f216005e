"""Load an HF checkpoint directory: config.json, single or sharded safetensors, tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from lever_actors.checkpoints.checkpoint import Checkpoint, check_layer_count
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.errors import CheckpointError
from lever_actors.model.args import ModelArgs, args_from_hf_config
from lever_actors.model.shapes import expected_shapes, is_norm, layer_tensor_names
from lever_actors.model.weights import ModelWeights, stored_tensors
from lever_actors.paths import file_inside

GLOBAL_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "wqkv": "self_attn.qkv_proj.weight",
    "w_gate_up": "mlp.gate_up_proj.weight",
}
# Gemma 2 norms its sublayers' inputs and outputs: post_attention_layernorm is an output's
_GEMMA_LAYER_NAMES = LAYER_NAMES | {
    "post_attn_norm": "post_attention_layernorm.weight",
    "ffn_norm": "pre_feedforward_layernorm.weight",
    "post_ffn_norm": "post_feedforward_layernorm.weight",
}


def read_hf_args(directory: Path) -> ModelArgs:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: not an HF checkpoint directory (no config.json)")
    return args_from_hf_config(_read_json(config_path), str(config_path))


def load_hf(directory: Path, dtype: torch.dtype) -> Checkpoint:
    """Read an HF checkpoint into DRAM as `dtype`, after checking its config and every
    tensor's shape (from the safetensors headers) against what the config implies."""
    args = read_hf_args(directory)
    tensors = _SafetensorsIndex(directory)
    _check_tensors(args, tensors, directory / "config.json")

    def load(ours: str, layer: int | None = None) -> torch.Tensor:
        name = hf_name(ours, layer, args)
        if is_norm(ours) and args.norm_offset:
            return (tensors.get(name, torch.float64) + args.norm_offset).to(dtype)
        return tensors.get(name, dtype)

    embed = load("embed")
    weights = ModelWeights(
        embed=embed,
        final_norm=load("final_norm"),
        lm_head=embed if args.tie_embeddings else load("lm_head"),
        layers=[
            {name: load(name, i) for name in layer_tensor_names(args)} for i in range(args.n_layers)
        ],
    )
    tokenizer_path = directory / "tokenizer.json"
    tokenizer = Tokenizer.from_file(tokenizer_path) if tokenizer_path.is_file() else None
    return Checkpoint(args=args, weights=weights, tokenizer=tokenizer, source=directory)


def hf_name(ours: str, layer: int | None, args: ModelArgs) -> str:
    """The HF name of our tensor `ours` of `layer` (None for the embedding, norm and head)."""
    if layer is None:
        return GLOBAL_NAMES[ours]
    names = _GEMMA_LAYER_NAMES if args.gemma else LAYER_NAMES
    return f"model.layers.{layer}.{names[ours]}"


def _check_tensors(args: ModelArgs, tensors: _SafetensorsIndex, config_path: Path) -> None:
    """Every tensor the model needs has the shape the config implies, and no layer lies past
    num_hidden_layers; read from the safetensors headers, before any tensor is loaded."""
    expected = expected_shapes(args)
    for ours, layer in stored_tensors(args):
        name = hf_name(ours, layer, args)
        shape = tensors.shape(name)
        if shape != expected[ours]:
            raise CheckpointError(
                f"{tensors.shard_of[name]}: tensor {name!r} has shape {shape}, "
                f"{config_path} implies {expected[ours]}"
            )
    field = f"{config_path}: num_hidden_layers"
    check_layer_count(tensors.shard_of, ("model", "layers"), args.n_layers, field)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (ValueError, RecursionError, OSError) as e:
        # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: unreadable JSON ({type(e).__name__}: {e})") from None


class _SafetensorsIndex:
    """Finds each tensor in whichever shard holds it."""

    def __init__(self, directory: Path) -> None:
        self._open: dict[Path, Any] = {}
        index_path = directory / "model.safetensors.index.json"
        if index_path.is_file():
            self.shard_of = {
                name: file_inside(directory, shard, "weight_map shard")
                for name, shard in _weight_map(index_path).items()
            }
        else:
            single = directory / "model.safetensors"
            if not single.is_file():
                raise CheckpointError(f"{directory}: no model.safetensors nor an index of shards")
            self.shard_of = {name: single for name in self._file(single).keys()}

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from its shard's header."""
        path = self._path(name)
        try:
            return tuple(self._file(path).get_slice(name).get_shape())
        except SafetensorError as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from None

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        path = self._path(name)
        try:
            return self._file(path).get_tensor(name).to(dtype)
        except SafetensorError as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from None

    def _path(self, name: str) -> Path:
        path = self.shard_of.get(name)
        if path is None:
            where = ", ".join(sorted({str(p) for p in self.shard_of.values()}))
            raise CheckpointError(f"{where}: tensor {name!r} is missing")
        return path

    def _file(self, path: Path) -> Any:
        """The shard opened once (safe_open reads its header)."""
        if path not in self._open:
            try:
                self._open[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        return self._open[path]


def _weight_map(index_path: Path) -> dict[str, Any]:
    index = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: no 'weight_map' object")
    return weight_map
