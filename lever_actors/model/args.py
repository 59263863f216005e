"""Model hyper-parameters for the Llama family (Llama, Qwen2, Qwen3), read from HF or GGUF."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from lever_actors.errors import CheckpointError

Architecture = Literal["llama", "qwen2", "qwen3"]
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3")


class RopeScaling(msgspec.Struct, frozen=True):
    """RoPE frequency scaling: 'linear' divides positions, 'llama3' rescales low frequencies."""

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelArgs(msgspec.Struct, frozen=True):
    """Everything the transformer math needs to know about one model."""

    arch: Architecture
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    max_seq_len: int
    tie_embeddings: bool
    rope_scaling: RopeScaling | None = None

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"


def check_architecture(model_type: str, source: str) -> Architecture:
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{source}: unsupported model_type {model_type!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return model_type  # type: ignore[return-value]


def args_from_hf_config(config: dict[str, Any], source: str) -> ModelArgs:
    """Build ModelArgs from a transformers `config.json` dict; `source` names it in errors."""
    arch = check_architecture(str(config.get("model_type")), source)
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise CheckpointError(f"{source}: llama attention_bias/mlp_bias are not supported")
    # transformers >= 5 nests RoPE settings in rope_parameters; older configs keep them flat
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    try:
        n_heads = int(config["num_attention_heads"])
        d_model = int(config["hidden_size"])
        head_dim = config.get("head_dim") or d_model // n_heads
        return ModelArgs(
            arch=arch,
            vocab_size=int(config["vocab_size"]),
            d_model=d_model,
            n_layers=int(config["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            ffn_dim=int(config["intermediate_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta") or config.get("rope_theta", 10000.0)),
            max_seq_len=int(config.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=_rope_scaling_from_hf(rope, source),
        )
    except KeyError as missing:
        raise CheckpointError(f"{source}: config.json lacks {missing.args[0]!r}") from None


def _rope_scaling_from_hf(scaling: dict[str, Any], source: str) -> RopeScaling | None:
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(scaling["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    raise CheckpointError(
        f"{source}: unsupported rope_scaling type {kind!r}; supported: linear, llama3"
    )
