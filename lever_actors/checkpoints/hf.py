"""Load an HF checkpoint directory: config.json, single or sharded safetensors, tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lever_actors.checkpoints.checkpoint import Checkpoint, file_inside
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.errors import CheckpointError
from lever_actors.model.args import ModelArgs, args_from_hf_config
from lever_actors.model.weights import ModelWeights, layer_tensor_names

GLOBAL_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight"}
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
}


def read_hf_args(directory: Path) -> ModelArgs:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: not an HF checkpoint directory (no config.json)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: invalid JSON ({e})") from None
    return args_from_hf_config(config, str(config_path))


def load_hf(directory: Path, dtype: torch.dtype) -> Checkpoint:
    args = read_hf_args(directory)
    tensors = _SafetensorsIndex(directory)
    layers = [
        {
            name: tensors.get(f"model.layers.{i}.{LAYER_NAMES[name]}", dtype)
            for name in layer_tensor_names(args)
        }
        for i in range(args.n_layers)
    ]
    embed = tensors.get(GLOBAL_NAMES["embed"], dtype)
    lm_head = embed if args.tie_embeddings else tensors.get("lm_head.weight", dtype)
    weights = ModelWeights(
        embed=embed,
        final_norm=tensors.get(GLOBAL_NAMES["final_norm"], dtype),
        lm_head=lm_head,
        layers=layers,
    )
    tokenizer_path = directory / "tokenizer.json"
    tokenizer = Tokenizer.from_file(tokenizer_path) if tokenizer_path.is_file() else None
    return Checkpoint(args=args, weights=weights, tokenizer=tokenizer, source=directory)


class _SafetensorsIndex:
    """Finds each tensor in whichever shard holds it."""

    def __init__(self, directory: Path) -> None:
        index_path = directory / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text())["weight_map"]
            self.shard_of = {
                name: file_inside(directory, shard, "weight_map shard")
                for name, shard in weight_map.items()
            }
        else:
            single = directory / "model.safetensors"
            if not single.is_file():
                raise CheckpointError(f"{directory}: no model.safetensors nor an index of shards")
            self.shard_of = {name: single for name in _tensor_names(single)}
        self._open: dict[Path, object] = {}

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        path = self.shard_of.get(name)
        if path is None:
            raise CheckpointError(f"{self._where()}: tensor {name!r} is missing")
        try:
            if path not in self._open:
                self._open[path] = safe_open(str(path), framework="pt")
            return self._open[path].get_tensor(name).to(dtype)  # type: ignore[attr-defined]
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from None

    def _where(self) -> str:
        return ", ".join(sorted({str(p) for p in self.shard_of.values()}))


def _tensor_names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
