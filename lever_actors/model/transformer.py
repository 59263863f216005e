"""A whole model held in DRAM: embedding, layers, final norm and LM head."""

from __future__ import annotations

import torch

from lever_actors.model.args import ModelArgs
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.layers import layer_forward, output_logits
from lever_actors.model.masks import causal_mask
from lever_actors.model.rope import Rope
from lever_actors.model.weights import ModelWeights


class Transformer:
    """Runs all layers in order over pending tokens; the weights never leave DRAM."""

    def __init__(self, args: ModelArgs, weights: ModelWeights) -> None:
        self.args = args
        self.weights = weights
        self.rope = Rope(args)
        self.dtype = weights.embed.dtype

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.args, capacity, self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens: [n] -> final hidden states [n, d_model]; leaves n pending positions in cache.

        Without `positions`/`mask` the tokens are a chain continuing the committed context.
        """
        n = tokens.shape[0]
        if positions is None:
            positions = torch.arange(cache.length, cache.length + n)
            mask = causal_mask(cache.length, n)
        rope = self.rope.tables(positions, self.dtype)
        x = self.weights.embed[tokens]
        for i, layer in enumerate(self.weights.layers):
            x = layer_forward(x, layer, self.args, cache, i, rope, mask)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, d_model] -> [n, vocab]"""
        w = self.weights
        return output_logits(hidden, w.final_norm, w.lm_head, self.args.norm_eps)
