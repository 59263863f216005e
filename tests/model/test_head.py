"""The LM head's products: a head on our kernels multiplies in as few calls as its logits'
bytes allow, with the same bits as in HEAD_ROWS blocks (a streamed head's parts); torch's
dense products keep HEAD_ROWS blocks, which fix their sums' order."""

from __future__ import annotations

import torch

from lever_actors.checkpoints.quantize import quantize_q6k
from lever_actors.model.layers import head_block, head_products
from lever_actors.model.row_blocks import linear
from lever_actors.model.shapes import HEAD_ROWS, HEAD_TEMP_BYTES
from lever_actors.model.weights import row_range
from tests.model.test_native import weight

ROWS = 2 * HEAD_ROWS + 64  # two whole blocks and a short one (our kernels take 64 at a time)


def products(normed: torch.Tensor, head, parts: int) -> torch.Tensor:
    """The logits of `normed` as head_products fills them from `parts` pieces of the head."""
    out = normed.new_empty(len(normed), head.shape[0])
    edges = [*range(0, head.shape[0], head.shape[0] // parts // HEAD_ROWS * HEAD_ROWS)][:parts]
    for lo, hi in zip(edges, [*edges[1:], head.shape[0]], strict=True):
        head_products(normed, row_range(head, lo, hi), out[:, lo:hi])
    return out


def test_a_head_on_our_kernels_gives_the_same_logits_whole_or_in_parts():
    head = quantize_q6k(weight((ROWS, 256)))
    normed = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert head.on_our_kernels(len(normed))
    whole = linear(normed, head)
    assert torch.equal(products(normed, head, 1), whole)
    assert torch.equal(products(normed, head, 2), whole)  # a streamed head's parts


def test_our_kernels_take_the_head_whole_for_a_few_rows_and_in_bounded_blocks_for_many():
    head = quantize_q6k(weight((ROWS, 256)))
    assert head_block(head, 1) >= ROWS
    many = HEAD_TEMP_BYTES // (2 * HEAD_ROWS)  # rows whose logits fill the bound per block
    assert head_block(head, many) == HEAD_ROWS
    assert head_block(head, 4 * many) == HEAD_ROWS  # never below one block
    assert head_block(weight((ROWS, 256)), 1) == HEAD_ROWS  # torch's dense products
