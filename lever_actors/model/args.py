"""Model hyper-parameters for the Llama family (Llama, Qwen2, Qwen3), read from HF or GGUF."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
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


COUNT_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "ffn_dim",
    "max_seq_len",
)


def check_args(args: ModelArgs, source: str, names: Mapping[str, str] | None = None) -> ModelArgs:
    """`args` if every count is positive, the heads group evenly and every float is finite and
    in range; else a CheckpointError naming `source` and the field, as `names` spells it there
    (our field name -> the source's key, e.g. "n_kv_heads" -> "num_key_value_heads")."""
    names = names or {}

    def field(ours: str) -> str:
        return names.get(ours, ours)

    for ours in COUNT_FIELDS:
        if getattr(args, ours) <= 0:
            raise CheckpointError(
                f"{source}: {field(ours)} = {getattr(args, ours)} is not positive"
            )
    if args.n_heads % args.n_kv_heads:
        raise CheckpointError(
            f"{source}: {field('n_kv_heads')} = {args.n_kv_heads} does not divide "
            f"{field('n_heads')} = {args.n_heads}"
        )
    if args.head_dim % 2:
        # RoPE rotates pairs of dimensions
        raise CheckpointError(f"{source}: {field('head_dim')} = {args.head_dim} is odd")
    _check_float(args.norm_eps, field("norm_eps"), source, upper=1.0)
    _check_float(args.rope_theta, field("rope_theta"), source)
    if args.rope_scaling is not None:
        _check_rope_scaling(args.rope_scaling, source, field)
    return args


def _check_float(value: float, name: str, source: str, upper: float = math.inf) -> None:
    if not (math.isfinite(value) and 0 < value < upper):
        bounds = "finite and positive" if upper == math.inf else f"in (0, {upper})"
        raise CheckpointError(f"{source}: {name} = {value} is not {bounds}")


def _check_rope_scaling(s: RopeScaling, source: str, field: Callable[[str], str]) -> None:
    _check_float(s.factor, field("rope_scaling.factor"), source)
    if s.kind != "llama3":
        return
    _check_float(s.low_freq_factor, field("rope_scaling.low_freq_factor"), source)
    _check_float(s.high_freq_factor, field("rope_scaling.high_freq_factor"), source)
    if s.high_freq_factor <= s.low_freq_factor:
        # llama3 scaling interpolates between the two: their difference is a divisor
        raise CheckpointError(
            f"{source}: {field('rope_scaling.high_freq_factor')} = {s.high_freq_factor} is not "
            f"above {field('rope_scaling.low_freq_factor')} = {s.low_freq_factor}"
        )
    if s.original_max_position_embeddings <= 0:
        name = field("rope_scaling.original_max_position_embeddings")
        raise CheckpointError(
            f"{source}: {name} = {s.original_max_position_embeddings} is not positive"
        )


def check_architecture(model_type: str, source: str) -> Architecture:
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{source}: unsupported model_type {model_type!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return model_type  # type: ignore[return-value]


class _HfRope(msgspec.Struct):
    """RoPE settings of a config.json: `rope_parameters` (transformers >= 5) or `rope_scaling`."""

    rope_type: str | None = None
    type: str | None = None  # the older spelling of rope_type
    rope_theta: float | None = None
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


class _HfConfig(msgspec.Struct):
    """The config.json fields we read, with their JSON types; other fields are ignored."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None
    mlp_bias: bool | None = None
    rope_parameters: _HfRope | None = None
    rope_scaling: _HfRope | None = None


# ModelArgs field -> the config.json key it comes from, for error messages
HF_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "ffn_dim": "intermediate_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "max_seq_len": "max_position_embeddings",
}


def args_from_hf_config(config: Any, source: str) -> ModelArgs:
    """Build and check ModelArgs from a transformers `config.json` value; `source` names it."""
    if not isinstance(config, dict):
        raise CheckpointError(f"{source}: not a JSON object but {type(config).__name__}")
    arch = check_architecture(str(config.get("model_type")), source)
    try:
        c = msgspec.convert(config, _HfConfig)
    except msgspec.ValidationError as e:
        raise CheckpointError(f"{source}: {e}") from None
    if c.attention_bias or c.mlp_bias:
        raise CheckpointError(f"{source}: llama attention_bias/mlp_bias are not supported")
    # transformers >= 5 nests RoPE settings in rope_parameters; older configs keep them flat
    rope = c.rope_parameters or c.rope_scaling or _HfRope()
    # a zero head count is reported by check_args, not divided by here
    default_head_dim = c.hidden_size // c.num_attention_heads if c.num_attention_heads > 0 else 0
    args = ModelArgs(
        arch=arch,
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        n_kv_heads=_first_set(c.num_key_value_heads, c.num_attention_heads),
        head_dim=_first_set(c.head_dim, default_head_dim),
        ffn_dim=c.intermediate_size,
        norm_eps=c.rms_norm_eps,
        rope_theta=_first_set(rope.rope_theta, c.rope_theta, 10000.0),
        max_seq_len=c.max_position_embeddings,
        tie_embeddings=c.tie_word_embeddings,
        rope_scaling=_rope_scaling_from_hf(rope, source),
    )
    return check_args(args, source, HF_CONFIG_KEYS)


def _first_set(*values: Any) -> Any:
    # null in a config.json means "the default", the last value; 0 is a value, checked later
    return next(value for value in values if value is not None)


_ROPE_FIELDS = {
    "linear": ("factor",),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
}


def _rope_scaling_from_hf(rope: _HfRope, source: str) -> RopeScaling | None:
    kind = rope.rope_type or rope.type
    if kind in (None, "default"):
        return None
    if kind not in _ROPE_FIELDS:
        raise CheckpointError(
            f"{source}: unsupported rope_scaling type {kind!r}; supported: linear, llama3"
        )
    values = {name: getattr(rope, name) for name in _ROPE_FIELDS[kind]}
    missing = [name for name, value in values.items() if value is None]
    if missing:
        raise CheckpointError(f"{source}: {kind} rope scaling lacks {', '.join(missing)}")
    return RopeScaling(kind=kind, **values)
