"""A whole model held in DRAM: embedding, layers, final norm and LM head."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from lever_actors.model.args import ModelArgs
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.layers import (
    Block,
    batch_layers_forward,
    embedding,
    layers_forward,
    output_logits,
)
from lever_actors.model.placement import Placement, chain_placement
from lever_actors.model.rope import Rope
from lever_actors.model.weights import ModelWeights, cuts_into_rows, row_range


class Transformer:
    """Runs all layers in order over pending tokens; the weights never leave DRAM."""

    def __init__(self, args: ModelArgs, weights: ModelWeights) -> None:
        self.args = args
        self.weights = weights
        self.rope = Rope(args)
        self.dtype = weights.embed.dtype

    def proposing(self, vocabulary: int | None) -> Transformer:
        """The same model whose logits cover only the token ids below `vocabulary`, for a
        draft: its LM head then multiplies those rows alone. Itself where `vocabulary` is
        None or covers every id, or where the head's rows cannot be cut apart (4-bit)."""
        head = self.weights.lm_head
        if vocabulary is None or vocabulary >= head.shape[0] or not cuts_into_rows(head):
            return self
        weights = replace(self.weights, lm_head=row_range(head, 0, vocabulary))
        return Transformer(self.args, weights)

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.args, capacity, self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        place: Placement | None = None,
        pause: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """tokens: [n] -> final hidden states [n, d_model], leaving n pending entries in cache.

        Without `place` the tokens are a chain continuing the committed context. `pause` is
        called after each layer (a compute unit's other jobs may run there).
        """
        if place is None:
            place = chain_placement(self.rope, cache.length, tokens.shape[0], self.dtype)
        x = embedding(self.weights.embed[tokens], self.args)
        for i, layer in enumerate(self.weights.layers):
            x = layers_forward(x, [layer], self.args, cache, i, place)
            if pause is not None:
                pause()
        return x

    @torch.inference_mode()
    def forward_blocks(
        self, tokens: Sequence[torch.Tensor], blocks: Sequence[Block]
    ) -> list[torch.Tensor]:
        """Several sequences' pending tokens, tokens[i]: [n_i] placed in blocks[i] (its own
        KV cache and placement) -> each one's final hidden states [n_i, d_model], their rows
        through each layer together."""
        xs = [embedding(self.weights.embed[t], self.args) for t in tokens]
        for i, layer in enumerate(self.weights.layers):
            xs = batch_layers_forward(xs, [layer], self.args, blocks, i)
        return xs

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, d_model] -> [n, vocab]"""
        w = self.weights
        return output_logits(hidden, w.final_norm, w.lm_head, self.args)
