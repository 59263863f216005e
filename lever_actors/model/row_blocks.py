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
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F

LARGEST_BLOCK = 64
# output features a probe computes: a row's rounding depends on the reduction over the
# input features, not on how many outputs the call has (checked in tests/model/test_tree.py);
# at most PROBE_FEATURES, and about PROBE_VALUES weights (16 MB of float32) for wide inputs
PROBE_FEATURES = 1024
PROBE_VALUES = 1 << 22

Product = Callable[[torch.Tensor], torch.Tensor]  # rows [n, in] -> [n, out]
Probe = Callable[[], tuple[torch.Tensor, Product]]  # LARGEST_BLOCK probe rows and a product

_blocks: dict[Hashable, int] = {}
_lock = threading.Lock()


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for x: [n, in] -> [n, out], each row computed as one-token decoding computes
    it, whatever n. float64 runs as one call: its rounding (1e-16) cannot move an argmax.
    A quantized weight (model/quantized.py) runs its own kernel, blocked the same way."""
    if not isinstance(weight, torch.Tensor):
        return weight.linear(x, bias)
    if weight.dtype == torch.float64:
        return F.linear(x, weight, bias)
    return blocked(x, lambda rows: F.linear(rows, weight, bias), *_dense_key(weight, bias))


def dense_row_block(weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The rows one kernel call may take for this dense weight's shape and dtype."""
    return row_block(*_dense_key(weight, bias))


def _dense_key(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[Hashable, Probe]:
    n_out, n_in = weight.shape
    key = (weight.dtype, n_out, n_in, bias is not None)
    return key, lambda: dense_probe(
        weight.dtype, probe_features(n_out, n_in), n_in, bias is not None
    )[:2]


def probe_features(n_out: int, n_in: int) -> int:
    """Output features of the probe for a weight [n_out, n_in]: all up to the caps above,
    else a multiple of 16 (as 4-bit packing takes them)."""
    cap = min(PROBE_FEATURES, PROBE_VALUES // n_in) // 16 * 16
    return min(n_out, max(16, cap))


def blocked(x: torch.Tensor, product: Product, key: Hashable, probe: Probe) -> torch.Tensor:
    """product(x) computed in calls of the row block measured (once per `key`) with `probe`."""
    block = row_block(key, probe)
    n = x.shape[0]
    if n == block:
        return product(x)
    parts = [_padded(product, x[i : i + block]) for i in range(0, n, block)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def row_block(key: Hashable, probe: Probe) -> int:
    """The rows one kernel call may take for the products of `key` (measured once)."""
    block = _blocks.get(key)
    if block is None:
        block = _measure(*probe())
        with _lock:
            _blocks[key] = block
    return block


def _padded(product: Product, x: torch.Tensor) -> torch.Tensor:
    """x: [n, in] with n <= the block; zero rows pad n to a power of two, at least 2."""
    n = x.shape[0]
    size = max(2, 1 << (n - 1).bit_length())
    if size > n:
        x = torch.cat((x, x.new_zeros(size - n, x.shape[1])))
    return product(x)[:n]


def _measure(x: torch.Tensor, product: Product) -> int:
    """The largest power of two (2 to LARGEST_BLOCK) at which every size up to it gives each
    of the probe's rows exactly its result computed alone."""
    alone = torch.cat([_padded(product, x[i : i + 1]) for i in range(LARGEST_BLOCK)])
    block = 2
    while block < LARGEST_BLOCK and torch.equal(
        torch.cat([product(x[i : i + 2 * block]) for i in range(0, LARGEST_BLOCK, 2 * block)]),
        alone,
    ):
        block *= 2
    return block


def probe_inputs(dtype: torch.dtype, n_out: int, n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs whose products cancel in pairs (the second half of each row repeats the first,
    the weights' second half negates theirs): every result is the rounding left over by the
    order of accumulation, so two kernels that accumulate differently differ almost
    everywhere, where random data would differ in one element in ten thousand.
    -> x: [LARGEST_BLOCK, n_in] in `dtype`, weight: [n_out, n_in] float32"""
    generator = torch.Generator().manual_seed(0)
    half = n_in // 2
    x = torch.zeros(LARGEST_BLOCK, n_in)
    x[:, :half] = torch.randn(LARGEST_BLOCK, half, generator=generator) * 16
    x[:, half : 2 * half] = x[:, :half]
    weight = torch.zeros(n_out, n_in)  # filled in place: a probe may be 55 MB of float32
    weight[:, :half].normal_(generator=generator)
    weight[:, half : 2 * half].copy_(weight[:, :half]).neg_()
    return x.to(dtype), weight


def dense_probe(dtype: torch.dtype, n_out: int, n_in: int, bias: bool):
    """-> the probe's rows, its product, and the dense weight and bias (if any) it uses."""
    x, weight = probe_inputs(dtype, n_out, n_in)
    weight = weight.to(dtype)
    residue = F.linear(x[:2], weight).abs().float().mean()  # the scale of what is left over
    generator = torch.Generator().manual_seed(1)
    b = (torch.randn(n_out, generator=generator) * residue).to(dtype) if bias else None
    return x, lambda rows: F.linear(rows, weight, b), weight, b
