"""Attention masks for a block of n pending tokens after `context` committed ones."""

from __future__ import annotations

import torch


def with_context(context: int, block: torch.Tensor) -> torch.Tensor:
    """block: [n, n] bool among pending tokens -> [n, context+n]; context is always visible."""
    n = block.shape[0]
    return torch.cat((torch.ones(n, context, dtype=torch.bool), block), dim=1)


def causal_mask(context: int, n: int) -> torch.Tensor | None:
    """[n, context+n] bool for a chain of n tokens; None when n == 1 (attend to everything)."""
    if n == 1:
        return None
    return with_context(context, torch.ones(n, n, dtype=torch.bool).tril())


def within_window(
    mask: torch.Tensor | None, queries: torch.Tensor, keys: torch.Tensor, window: int
) -> torch.Tensor:
    """`mask` ([n, T] or None: all visible) narrowed to keys less than `window` positions
    behind each query. queries: [n] and keys: [T] positions -> [n, T] bool."""
    near = queries[:, None] - keys[None, :] < window
    return near if mask is None else mask & near
