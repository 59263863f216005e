"""Row blocks for matrix products whose rows round as in one-token decoding.

A BLAS library picks its kernel by the number of rows: oneDNN's bf16 matrix-vector path
rounds differently from its matrix-matrix one, and on a Xeon with AMX its matrix-matrix
kernel changes again past 32 rows (float32 past 8). A row's result then depends on how many
rows share the call, and at a near-tie that flips the target's choice. So `linear` only
ever calls the kernel with a power-of-two number of rows from 2 up to a block measured on
this machine, for this weight's shape: the largest size at which every row equals the same
row computed alone (padded to 2 rows, as one-token decoding computes it), on inputs built
so that any change in the order of accumulation shows.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

LARGEST_BLOCK = 64
# output features a probe computes: a row's rounding depends on the reduction over the
# input features, not on how many outputs the call has (checked in tests/model/test_tree.py)
PROBE_FEATURES = 4096

_blocks: dict[tuple, int] = {}
_lock = threading.Lock()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for x: [n, in] -> [n, out], each row computed as one-token decoding computes
    it, whatever n. float64 runs as one call: its rounding (1e-16) cannot move an argmax."""
    if weight.dtype == torch.float64:
        return F.linear(x, weight, bias)
    block = row_block(weight, bias)
    n = x.shape[0]
    if n == block:
        return F.linear(x, weight, bias)
    parts = [_padded_linear(x[i : i + block], weight, bias) for i in range(0, n, block)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def row_block(weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The rows one kernel call may take for this weight's shape and dtype (measured once)."""
    n_out, n_in = weight.shape
    key = (weight.dtype, n_out, n_in, bias is not None)
    block = _blocks.get(key)
    if block is None:
        block = _measure(weight.dtype, min(n_out, PROBE_FEATURES), n_in, bias is not None)
        with _lock:
            _blocks[key] = block
    return block


def _padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """x: [n, in] with n <= the block; zero rows pad n to a power of two, at least 2."""
    n = x.shape[0]
    size = max(2, 1 << (n - 1).bit_length())
    if size > n:
        x = torch.cat((x, x.new_zeros(size - n, x.shape[1])))
    return F.linear(x, weight, bias)[:n]


def _measure(dtype: torch.dtype, n_out: int, n_in: int, bias: bool) -> int:
    """The largest power of two (2 to LARGEST_BLOCK) at which every size up to it gives each
    of the probe's rows exactly its result computed alone."""
    x, weight, b = _probe(dtype, n_out, n_in, bias)
    alone = torch.cat([_padded_linear(x[i : i + 1], weight, b) for i in range(LARGEST_BLOCK)])
    block = 2
    while block < LARGEST_BLOCK and torch.equal(
        torch.cat(
            [F.linear(x[i : i + 2 * block], weight, b) for i in range(0, LARGEST_BLOCK, 2 * block)]
        ),
        alone,
    ):
        block *= 2
    return block


def _probe(dtype: torch.dtype, n_out: int, n_in: int, bias: bool):
    """Inputs whose products cancel in pairs (the second half of each row repeats the first,
    the weights' second half negates theirs): every result is the rounding left over by the
    order of accumulation, so two kernels that accumulate differently differ almost
    everywhere, where random data would differ in one element in ten thousand."""
    generator = torch.Generator().manual_seed(0)
    half = n_in // 2
    x = torch.zeros(LARGEST_BLOCK, n_in)
    x[:, :half] = torch.randn(LARGEST_BLOCK, half, generator=generator) * 16
    x[:, half : 2 * half] = x[:, :half]
    weight = torch.zeros(n_out, n_in)
    weight[:, :half] = torch.randn(n_out, half, generator=generator)
    weight[:, half : 2 * half] = -weight[:, :half]
    x, weight = x.to(dtype), weight.to(dtype)
    residue = F.linear(x[:2], weight).abs().float().mean()  # the scale of what is left over
    b = (torch.randn(n_out, generator=generator) * residue).to(dtype) if bias else None
    return x, weight, b
