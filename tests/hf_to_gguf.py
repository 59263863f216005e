"""Write a transformers model as llama.cpp's converter would (its tensor names, q/k row
permutation for llama, Gemma's norms stored as 1 + w, Llama 3.1's rope_freqs tensor), but in
float64, so that a GGUF read can be compared with transformers at 1e-9."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import torch
import transformers

from tests.spm import gguf_type

# transformers' model_type -> llama.cpp's architecture (it converts Mistral as llama)
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "phi3": "phi3",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GEMMA_LAYER = _LAYER | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def write_gguf_of(
    model: transformers.PreTrainedModel, path: Path, tokenizer: dict[str, Any] | None = None
) -> Path:
    """`model`'s weights and hyper-parameters as a GGUF file at `path`, every tensor F64,
    with the `tokenizer` metadata given (key -> value; see tests/spm.py)."""
    config = model.config
    arch = GGUF_ARCH[config.model_type]
    writer = gguf.GGUFWriter(path, arch)
    _write_metadata(writer, config, arch)
    for key, value in (tokenizer or {}).items():
        writer.add_key_value(key, value, *gguf_type(value))
    for name, tensor in _gguf_tensors(model, arch):
        writer.add_tensor(name, tensor.detach().to(torch.float64).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(writer: gguf.GGUFWriter, config, arch: str) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch in ("gemma2", "phi3") and config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _gguf_tensors(model: transformers.PreTrainedModel, arch: str):
    config = model.config
    layer_names = _GEMMA_LAYER if arch == "gemma2" else _LAYER
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, kind = name.rsplit(".", 1)
        if stem in _GLOBAL:
            out = f"{_GLOBAL[stem]}.{kind}"
        else:
            _, _, layer, sub = stem.split(".", 3)
            out = f"blk.{layer}.{layer_names[sub]}.{kind}"
        if arch == "llama" and sub_is(stem, "q_proj"):
            tensor = _permute(tensor, config.num_attention_heads)
        elif arch == "llama" and sub_is(stem, "k_proj"):
            tensor = _permute(tensor, config.num_key_value_heads)
        if arch == "gemma2" and stem.endswith("norm"):
            tensor = tensor + 1  # llama.cpp's Gemma stores the weight it applies
        yield out, tensor
    if config.rope_parameters.get("rope_type") == "llama3":
        yield "rope_freqs.weight", _llama3_freq_factors(config)


def sub_is(stem: str, projection: str) -> bool:
    return stem.endswith(f"self_attn.{projection}")


def _permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # the converter's q/k row order for llama.cpp's rotary layout: per head (2, half) -> (half, 2)
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llama3_freq_factors(config) -> torch.Tensor:
    """Per rotated pair, the divisor llama3 scaling applies to its frequency (the converter
    computes these in Python floats and stores them as a tensor)."""
    p = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * p["rope_theta"] ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return torch.tensor(factors, dtype=torch.float32)
