"""Tiny random checkpoints made with transformers' own classes: our test oracle."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import transformers

from lever_actors.testing.checkpoints import NORM_STD, WEIGHT_STD

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3")
WINDOW = 8  # sliding windows shorter than the tests' sequences, so that they matter
# Llama 3's RoPE scaling, its original context shortened to the tests' sequences
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# each architecture and its variants, id -> (arch, tiny_config's keywords)
HF_CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie": True}),
    "llama-rope-llama3": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie": True}),
    "qwen3": ("qwen3", {}),
    "mistral-window": ("mistral", {}),
    "mistral": ("mistral", {"window": None}),
    "gemma2": ("gemma2", {"tie": True}),
    "gemma2-untied-window3": ("gemma2", {"window": 3}),
    "phi3-window": ("phi3", {}),
    "phi3": ("phi3", {"window": None}),
}


def hf_cases(*ids: str) -> list:
    """HF_CASES as pytest parameters, each (arch, keywords) under its id: all, or those named."""
    return [pytest.param(HF_CASES[id_], id=id_) for id_ in ids or HF_CASES]


def tiny_config(
    arch: str,
    *,
    tie: bool = False,
    rope_scaling: dict | None = None,
    vocab: int = 97,
    layers: int = 2,
    window: int | None = WINDOW,
    query_scale: int = 24,
):
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if arch == "llama":
        params = {"rope_type": "default", "rope_theta": 500.0}
        if rope_scaling:
            params = {**rope_scaling, "rope_theta": 500.0}
        return transformers.LlamaConfig(**common, rope_parameters=params)
    if arch == "qwen2":
        return transformers.Qwen2Config(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 1e4}
        )
    if arch == "qwen3":
        # head_dim deliberately not hidden_size / heads, as Qwen3 allows
        return transformers.Qwen3Config(
            **common, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        )
    if arch == "mistral":
        return transformers.MistralConfig(
            **common,
            sliding_window=window,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        )
    if arch == "phi3":
        return transformers.Phi3Config(
            **common,
            sliding_window=window,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        )
    if arch == "gemma2":
        # layer 0 attends within the window, layer 1 to everything; caps small enough to bite
        return transformers.Gemma2Config(
            **common,
            head_dim=16,
            query_pre_attn_scalar=query_scale,  # Gemma 2 2B and 9B: head_dim
            sliding_window=window,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=8.0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        )
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, **config_kwargs) -> transformers.PreTrainedModel:
    """A float64 model whose weights (norms and biases included) are random and large enough
    to make logits far from ties (the spread lever_actors.testing gives its own checkpoints).
    transformers builds and saves it, so it checks our reader against their files."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **config_kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    # Gemma's norms apply 1 + w: their stored w is then near 0, the weight applied near 1
    offset = 1.0 if arch == "gemma2" else 0.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 - offset + NORM_STD * torch.randn_like(p))
            else:
                p.copy_(WEIGHT_STD * torch.randn_like(p))
    return model.eval()


def save_tiny(model: transformers.PreTrainedModel, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


def _rms_norm_float64(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # the stock forward drops to float32, which would hide float64 differences
    compute = torch.promote_types(hidden_states.dtype, torch.float32)
    h = hidden_states.to(compute)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(hidden_states.dtype)


def _gemma_rms_norm_float64(self, x: torch.Tensor) -> torch.Tensor:
    # Gemma's norm multiplies by 1 + w, and the stock forward computes in float32
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
    return (h * (1.0 + self.weight.to(h.dtype))).to(x.dtype)


def _gemma_attention_float64(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs
):
    # Gemma 2 runs its own eager attention, whose softmax is float32 whatever the inputs
    from transformers.models.gemma2.modeling_gemma2 import repeat_kv

    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = query @ key.transpose(2, 3) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    weights = torch.softmax(scores, dim=-1)
    return (weights @ value).transpose(1, 2).contiguous(), weights


@contextlib.contextmanager
def full_precision_norms():
    """Make transformers' RMSNorms (and Gemma 2's attention) keep float64 inputs in float64,
    as ours do."""
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.phi3 import modeling_phi3
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    patches = [
        (modeling_llama.LlamaRMSNorm, "forward", _rms_norm_float64),
        (modeling_mistral.MistralRMSNorm, "forward", _rms_norm_float64),
        (modeling_phi3.Phi3RMSNorm, "forward", _rms_norm_float64),
        (modeling_qwen2.Qwen2RMSNorm, "forward", _rms_norm_float64),
        (modeling_qwen3.Qwen3RMSNorm, "forward", _rms_norm_float64),
        (modeling_gemma2.Gemma2RMSNorm, "forward", _gemma_rms_norm_float64),
        (modeling_gemma2, "eager_attention_forward", _gemma_attention_float64),
    ]
    saved = [getattr(owner, name) for owner, name, _ in patches]
    try:
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        yield
    finally:
        for (owner, name, _), original in zip(patches, saved, strict=True):
            setattr(owner, name, original)


def their_greedy(theirs: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy `generate` of n tokens after `prompt`, in full precision."""
    with full_precision_norms(), torch.no_grad():
        out = theirs.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
