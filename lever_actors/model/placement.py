"""Where a block of pending tokens sits: rotary tables, attention mask, cache offsets."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lever_actors.model.masks import causal_mask
from lever_actors.model.rope import Rope
from lever_actors.model.tree import TokenTree


@dataclass(frozen=True)
class Placement:
    """For n tokens written into a KV cache's pending block.

    positions: [n] each token's position in its sequence (sliding windows count in these).
    offsets: [n] each token's slot in the pending block (None: 0..n-1).
    span: how much of the pending block attention sees (None: n).
    mask: [n, context+span] bool, True = may attend (None: everything).
    """

    positions: torch.Tensor  # [n] int64
    cos: torch.Tensor  # [n, head_dim]
    sin: torch.Tensor  # [n, head_dim]
    mask: torch.Tensor | None
    offsets: torch.Tensor | None = None
    span: int | None = None

    def rows(self, index: torch.Tensor) -> Placement:
        """The placement of a subset of the tokens (e.g. the nodes a pruner kept)."""
        offsets = self.offsets[index] if self.offsets is not None else index
        span = self.span if self.span is not None else self.cos.shape[0]
        mask = self.mask[index] if self.mask is not None else None
        return Placement(
            self.positions[index], self.cos[index], self.sin[index], mask, offsets, span
        )

    def chunk(self, lo: int, hi: int) -> Placement:
        """Tokens lo..hi-1 of a whole block placed at offsets 0..n-1 (a chain's or a tree's),
        seeing no pending slot from hi on: none of them attends there, since a token's
        ancestors come before it."""
        assert self.offsets is None and self.span is None  # a whole block's placement
        index = torch.arange(lo, hi)
        mask = None
        if self.mask is not None:
            context = self.mask.shape[1] - self.cos.shape[0]
            mask = self.mask[lo:hi, : context + hi]
        return Placement(self.positions[lo:hi], self.cos[lo:hi], self.sin[lo:hi], mask, index, hi)


def chain_placement(rope: Rope, context: int, n: int, dtype: torch.dtype) -> Placement:
    """n tokens continuing the committed context, each seeing the ones before it."""
    positions = torch.arange(context, context + n)
    cos, sin = rope.tables(positions, dtype)
    return Placement(positions, cos, sin, causal_mask(context, n))


def tree_placement(rope: Rope, context: int, tree: TokenTree, dtype: torch.dtype) -> Placement:
    """A whole tree at pending offsets 0..n-1; a node sees the context and its ancestors."""
    positions = tree.positions(context)
    cos, sin = rope.tables(positions, dtype)
    return Placement(positions, cos, sin, tree.attention_mask(context))
