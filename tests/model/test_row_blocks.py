"""Matrix products whose rows round as in one-token decoding, whatever the row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lever_actors.model.row_blocks import LARGEST_BLOCK, dense_probe, dense_row_block, linear

SHAPES = [(128, 512, True), (512, 512, True), (1536, 512, False), (512, 1536, False)]


def cancelling_rows(n_rows: int, n_out: int, n_in: int, bias: bool):
    """Rows whose results are the rounding of their accumulation order (see probe_inputs), so
    a kernel switch shows in most elements rather than one in ten thousand."""
    x, _, weight, b = dense_probe(torch.bfloat16, n_out, n_in, bias)
    rows = x.repeat(-(-n_rows // LARGEST_BLOCK), 1)[:n_rows]
    return rows * torch.linspace(0.5, 2, n_rows)[:, None].to(torch.bfloat16), weight, b


@pytest.mark.parametrize(("n_out", "n_in", "bias"), SHAPES)
@pytest.mark.parametrize("n_rows", [1, 3, 32, 33, 64, 65, 200])
def test_every_row_equals_the_row_computed_alone(n_out, n_in, bias, n_rows):
    x, weight, b = cancelling_rows(n_rows, n_out, n_in, bias)
    together = linear(x, weight, b)
    alone = torch.cat([linear(x[i : i + 1], weight, b) for i in range(n_rows)])
    differing = [i for i in range(n_rows) if not torch.equal(together[i], alone[i])]
    assert not differing, f"rows that round otherwise in a call of {n_rows}: {differing}"


@pytest.mark.parametrize(("n_out", "n_in", "bias"), SHAPES)
def test_the_block_is_a_power_of_two_that_the_kernel_keeps(n_out, n_in, bias):
    weight = torch.zeros(n_out, n_in, dtype=torch.bfloat16)
    block = dense_row_block(weight, torch.zeros(n_out, dtype=torch.bfloat16) if bias else None)
    assert block in (2, 4, 8, 16, 32, 64)
    x, w, b = cancelling_rows(block, n_out, n_in, bias)
    pairs = torch.cat(
        [F.linear(torch.cat((x[i : i + 1], x[:1] * 0)), w, b)[:1] for i in range(block)]
    )
    assert torch.equal(F.linear(x, w, b), pairs)


def test_float64_is_one_call():
    x, weight = torch.randn(70, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    assert torch.equal(linear(x, weight), F.linear(x, weight))
