"""Tiny random checkpoints made with transformers' own classes: our test oracle."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import transformers

from lever_actors.testing.checkpoints import NORM_STD, WEIGHT_STD

ARCHS = ("llama", "qwen2", "qwen3")


def tiny_config(
    arch: str,
    *,
    tie: bool = False,
    rope_scaling: dict | None = None,
    vocab: int = 97,
    layers: int = 2,
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
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, **config_kwargs) -> transformers.PreTrainedModel:
    """A float64 model whose weights (norms and biases included) are random and large enough
    to make logits far from ties (the spread lever_actors.testing gives its own checkpoints).
    transformers builds and saves it, so it checks our reader against their files."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **config_kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + NORM_STD * torch.randn_like(p))
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


@contextlib.contextmanager
def full_precision_norms():
    """Make transformers' RMSNorms keep float64 inputs in float64, as ours do."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    classes = [
        modeling_llama.LlamaRMSNorm,
        modeling_qwen2.Qwen2RMSNorm,
        modeling_qwen3.Qwen3RMSNorm,
    ]
    saved = [c.forward for c in classes]
    try:
        for c in classes:
            c.forward = _rms_norm_float64
        yield
    finally:
        for c, f in zip(classes, saved, strict=True):
            c.forward = f
