"""In-DRAM weights of one model: globals plus one dict of named tensors per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lever_actors.model.args import ModelArgs

LayerTensors = dict[str, torch.Tensor]


def layer_tensor_names(args: ModelArgs) -> tuple[str, ...]:
    """Names (and so the flash-layout order) of one layer's tensors for this architecture."""
    names = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down"]
    if args.qkv_bias:
        names += ["bq", "bk", "bv"]
    if args.qk_norm:
        names += ["q_norm", "k_norm"]
    return tuple(names)


@dataclass
class ModelWeights:
    """Shapes: embed/lm_head [vocab, d_model]; wq [n_heads*hd, d_model]; w_down [d_model, ffn]."""

    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # the same tensor object as `embed` when the model ties them
    layers: list[LayerTensors]

    def to(self, dtype: torch.dtype) -> ModelWeights:
        embed = self.embed.to(dtype)
        return ModelWeights(
            embed=embed,
            final_norm=self.final_norm.to(dtype),
            lm_head=embed if self.lm_head is self.embed else self.lm_head.to(dtype),
            layers=[{k: t.to(dtype) for k, t in layer.items()} for layer in self.layers],
        )
