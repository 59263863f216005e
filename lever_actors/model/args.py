"""Model hyper-parameters of the Llama family and its relatives (Llama, Mistral, Qwen2,
Qwen3, Gemma 2, Phi-3), read from HF or GGUF: one struct, the few differences as fields and
properties that the layer functions consult."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import msgspec

from lever_actors.errors import CheckpointError

Architecture = Literal["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3"]
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3")


class RopeScaling(msgspec.Struct, frozen=True):
    """RoPE frequency scaling: 'linear' divides positions, 'llama3' rescales low frequencies,
    'freq_factors' divides each pair's frequency by its own factor (a GGUF's rope_freqs)."""

    kind: Literal["linear", "llama3", "freq_factors"]
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    factors: tuple[float, ...] = ()  # freq_factors: one per rotated pair, [head_dim // 2]


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
    sliding_window: int | None = None  # a token attends to the keys of the last this many positions
    sliding_layers: tuple[int, ...] = ()  # ... in these layers; the others attend to all
    query_scale: float | None = None  # Gemma 2's query_pre_attn_scalar (None: head_dim)
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @property
    def fused_projections(self) -> bool:
        """Phi-3 stores q, k, v as one matrix and gate, up as another."""
        return self.arch == "phi3"

    @property
    def gemma(self) -> bool:
        """Gemma 2's differences: embeddings scaled by sqrt(d_model), norms after attention and
        after the feed-forward as well as before, a tanh-approximated GELU gate."""
        return self.arch == "gemma2"

    @property
    def norm_offset(self) -> float:
        """What HF checkpoints leave out of each norm weight (Gemma stores w and applies 1 + w);
        we hold, as GGUF files do, the weight applied."""
        return 1.0 if self.gemma else 0.0

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None where it attends to the whole context."""
        return self.sliding_window if layer in self.sliding_layers else None


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
        _check_rope_scaling(args.rope_scaling, args.head_dim, source, field)
    _check_windows(args, source, field)
    for name in ("query_scale", "attn_softcap", "final_softcap"):
        if getattr(args, name) is not None:
            _check_float(getattr(args, name), field(name), source)
    return args


def _check_windows(args: ModelArgs, source: str, field: Callable[[str], str]) -> None:
    if args.sliding_window is not None and args.sliding_window <= 0:
        raise CheckpointError(
            f"{source}: {field('sliding_window')} = {args.sliding_window} is not positive"
        )
    outside = [i for i in args.sliding_layers if not 0 <= i < args.n_layers]
    if outside:
        raise CheckpointError(
            f"{source}: sliding-window layers {outside} lie outside the {args.n_layers} layers"
        )


def _check_float(value: float, name: str, source: str, upper: float = math.inf) -> None:
    if not (math.isfinite(value) and 0 < value < upper):
        bounds = "finite and positive" if upper == math.inf else f"in (0, {upper})"
        raise CheckpointError(f"{source}: {name} = {value} is not {bounds}")


def _check_rope_scaling(
    s: RopeScaling, head_dim: int, source: str, field: Callable[[str], str]
) -> None:
    _check_float(s.factor, field("rope_scaling.factor"), source)
    if s.kind == "freq_factors":
        if len(s.factors) != head_dim // 2:
            raise CheckpointError(
                f"{source}: {field('rope_scaling.factors')} has {len(s.factors)} values, "
                f"one per rotated pair needs {head_dim // 2}"
            )
        for value in s.factors:
            _check_float(value, field("rope_scaling.factors"), source)
        return
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
    partial_rotary_factor: float | None = None


Unset = msgspec.UnsetType  # a key absent from config.json, where null means something else


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
    partial_rotary_factor: float | None = None
    hidden_act: str | None = None
    hidden_activation: str | None = None  # Gemma's spelling
    sliding_window: int | None | Unset = msgspec.UNSET
    layer_types: list[str] | None = None  # transformers >= 4.53: per layer, full or sliding
    use_sliding_window: bool = False  # Qwen2: sliding layers from max_window_layers on
    max_window_layers: int = 0
    query_pre_attn_scalar: float | Unset = msgspec.UNSET
    attn_logit_softcapping: float | None | Unset = msgspec.UNSET
    final_logit_softcapping: float | None | Unset = msgspec.UNSET


# transformers' defaults for the keys a config.json may leave out, per model_type
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096},
    "gemma2": {
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
}
_ACTIVATIONS = {"gemma2": "gelu_pytorch_tanh"}  # the others gate with SiLU


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
    "query_scale": "query_pre_attn_scalar",
    "attn_softcap": "attn_logit_softcapping",
    "final_softcap": "final_logit_softcapping",
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
    _check_hf_support(arch, c, rope, source)
    defaults = _HF_DEFAULTS.get(arch, {})

    def given(key: str) -> Any:
        value = getattr(c, key)
        return defaults.get(key) if value is msgspec.UNSET else value

    # a zero head count is reported by check_args, not divided by here
    default_head_dim = c.hidden_size // c.num_attention_heads if c.num_attention_heads > 0 else 0
    sliding_layers = _hf_sliding_layers(arch, c, given("sliding_window"), source)
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
        # a window no layer uses (Qwen2's configs carry one) is no window
        sliding_window=given("sliding_window") if sliding_layers else None,
        sliding_layers=sliding_layers,
        query_scale=given("query_pre_attn_scalar"),
        attn_softcap=given("attn_logit_softcapping"),
        final_softcap=given("final_logit_softcapping"),
    )
    return check_args(args, source, HF_CONFIG_KEYS)


def _check_hf_support(arch: str, c: _HfConfig, rope: _HfRope, source: str) -> None:
    """Refuse what the model core does not compute, rather than compute something else."""
    expected = _ACTIVATIONS.get(arch, "silu")
    activation = c.hidden_activation or c.hidden_act or expected
    if activation != expected:
        raise CheckpointError(
            f"{source}: {arch} with activation {activation!r} is unsupported; expected {expected!r}"
        )
    partial = _first_set(rope.partial_rotary_factor, c.partial_rotary_factor, 1.0)
    if partial != 1.0:
        raise CheckpointError(
            f"{source}: partial_rotary_factor = {partial} is unsupported (RoPE over whole heads)"
        )


def _hf_sliding_layers(arch: str, c: _HfConfig, window: int | None, source: str) -> tuple[int, ...]:
    """The layers that attend within `window`: as layer_types lists them, else as each
    model_type's transformers class decides."""
    if window is None:
        return ()
    layers = range(c.num_hidden_layers)
    if c.layer_types is not None:
        if len(c.layer_types) != c.num_hidden_layers:
            raise CheckpointError(
                f"{source}: layer_types lists {len(c.layer_types)} layers, "
                f"num_hidden_layers is {c.num_hidden_layers}"
            )
        return tuple(i for i in layers if c.layer_types[i] == "sliding_attention")
    if arch == "gemma2":
        return tuple(i for i in layers if i % 2 == 0)  # local, global, local, ...
    if arch == "qwen2":
        return tuple(i for i in layers if c.use_sliding_window and i >= c.max_window_layers)
    if arch in ("mistral", "phi3"):
        return tuple(layers)
    return ()


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
    return RopeScaling(kind=kind, **values)  # type: ignore[arg-type]  # a kind checked above
