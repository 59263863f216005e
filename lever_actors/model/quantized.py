"""Weights kept quantized: 4-, 6- and 8-bit matrices multiplied by our kernels (model/native.py)
where this CPU has them, else by torch's weight-only kernels, and a 4-bit embedding table
read a row at a time.

Formats (what a flash layout stores, and what DRAM holds):
- "int4": groups of GROUP inputs share a bf16 scale and zero, w = (q - 8) * scale + zero,
  q in 0..15. Stored as the packed [out, in] matrix ([out, in / 2] bytes, see `pack_int4`),
  then the scales and zeros ([in / GROUP, out, 2] bf16). The packing is one on every CPU (the
  one torch's CPU kernel reads where it has AVX-512), so a layout converted on one machine
  reads right on another, and our kernels use a layer where it was read.
- "int8": w = q * scale, q in -127..127, one bf16 scale per output row: [out, in] int8,
  then [out] bf16, as `aten._weight_int8pack_mm` reads them.
- "q6k": GGUF's Q6_K blocks as the file has them, row after row: a block of K_INPUTS inputs
  is 128 bytes of low nibbles, 64 of high bit pairs and 16 int8 sub-block scales
  ([out, in / 256 * 208] bytes), w = d * sc * (q - 32); then each block's float16 d
  ([out, in / 256]).
- "q4k": GGUF's Q4_K values, w = d * sc * q - dmin * m (q in 0..15; a 6-bit scale sc and
  minimum m per 32 inputs; a float16 d and dmin per 256), in a packing of ours: each 8
  outputs' block of 256 inputs is one record (see `pack_q4k`), [out / 8, blocks * 1152]
  bytes; then the records' d and dmin ([out / 8, blocks, 2, 8] float16). Inputs come in
  groups of 32, not always whole blocks: a last block's missing inputs are stored as zeros
  (`q4k_blocks_of`), and the kernel gives them zeros in x.
  The k-quants (K_FORMATS) have no torch kernel: where ours are absent their values are
  used as a bf16 matrix.
- "int4rows": the embedding table, row after row of [in / 2] bytes (the even input in the
  low nibble) then [in / GROUP, 2] bf16 scales and zeros: one contiguous record per row,
  so a token's row is one small read.
The matrix formats run on our kernels (model/native.py) where this CPU has them: they read
these same bytes, cost little per extra row and compute each row on its own by construction.
Elsewhere torch's run, checked like the dense kernels by row_blocks (int4 repacked once per weight
where torch packs otherwise). Either way a tree verified in one call equals one-token decoding
bit for bit. A process uses one kernel per matrix throughout.
Rounding float weights into q6k and q4k is conversion's alone (checkpoints/quantize.py); int4
and int8 are rounded here too, for the probe row_blocks measures torch's kernels with.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Literal

import torch

from lever_actors.model import native, row_blocks
from lever_actors.model.formats import (
    GROUP,
    K_FORMATS,
    K_INPUTS,
    PACK_TILES,
    Q4K_FILE_BYTES,
    Q4K_NIBBLES,
    Q4K_OUTPUTS,
    Q4K_RECORD,
    Q6K_BYTES,
    ROW_MATRIX_FORMATS,
    MatrixFormat,
    q4k_blocks_of,
    row_bytes,
    storage_bytes,
)

COMPUTE_DTYPE = torch.bfloat16  # the kernels' activations, scales and outputs


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A quantized [out, in] matrix: `data` and `scales` as in the module's formats."""

    fmt: MatrixFormat
    shape: tuple[int, int]
    # int4: [out, in / 2] uint8, the packing; int8: [out, in] int8; q6k: [out, in / 256 * 208]
    # uint8, the blocks less d; q4k: [out / 8, in / 256 * 1152] uint8, the records
    data: torch.Tensor
    # int4: [in / GROUP, out, 2] bf16 scale, zero; int8: [out] bf16; q6k: [out, in / 256] f16 d;
    # q4k: [out / 8, in / 256 * 16] f16, each record's 8 d then 8 dmin
    scales: torch.Tensor
    # False for a draft's matrices: each call takes the faster kernel for its rows, as a
    # draft's rounding only steers which tokens the target checks
    exact: bool = True

    dtype = COMPUTE_DTYPE

    @property
    def rows_readable(self) -> bool:
        """Whether a row's values can be read alone (not in the int4 and q4k packings)."""
        return self.fmt in ROW_MATRIX_FORMATS

    def on_our_kernels(self, rows: int) -> bool:
        """Whether a call with this many rows multiplies on our kernels (a draft's matrix,
        not exact, takes torch's below the rows where ours are faster)."""
        return native.fits(self.fmt, self.shape) and (
            self.exact or rows >= native.fewest_rows(self.fmt)
        )

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [n, in] -> [n, out] in x's dtype, computed in bf16; each row as if it were alone
        (if `exact`). Our kernels compute each row on its own by construction, so they need no
        row blocks."""
        if x.dtype != COMPUTE_DTYPE:  # a float32 model (generate --model's default)
            out = self.linear(x.to(COMPUTE_DTYPE)).to(x.dtype)
            return out if bias is None else out + bias
        if self.on_our_kernels(len(x)):
            return _KERNELS[self.fmt](x, self.data, self.scales, bias)
        if self.fmt in K_FORMATS:
            out = row_blocks.linear(x, bf16_values(self))
        elif self.exact:
            key = ("quantized", self.fmt, *self.shape)
            out = row_blocks.blocked(x, self._on_torch, key, lambda: _probe(self.fmt, *self.shape))
        else:
            out = self._on_torch(x)
        return out if bias is None else out + bias

    def _on_torch(self, x: torch.Tensor) -> torch.Tensor:
        """torch's weight-only kernel, x: [n, in] bf16 -> [n, out] bf16"""
        if self.fmt == "int4":
            packed = self.data if torch_packs_as_we_do(self.shape[0]) else torch_packing(self)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, self.scales)
        return torch.ops.aten._weight_int8pack_mm(x, self.data, self.scales)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """The row-stored matrix's rows `ids` as values, [n] -> [n, in] bf16: an embedding
        table (the rows of an int4 or q4k packing are not addressable)."""
        if not self.rows_readable:
            raise TypeError(f"the rows of a {self.fmt} packing cannot be read one by one")
        return self._rows(ids).to(COMPUTE_DTYPE)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a row-stored matrix as float32 values, [n] -> [n, in]."""
        if self.fmt == "int8":
            return self.data[ids].float() * self.scales[ids].float()[:, None]
        return q6k_values(self.data[ids], self.scales[ids])

    def products(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the matrix times h: [n] ids, [in] -> [n] float32 (the rows of an int4
        or q4k packing are not addressable: its product runs whole, then is picked from)."""
        if self.fmt == "int8":
            return (self.data[ids].float() @ h.float()) * self.scales[ids].float()
        if self.fmt == "q6k":
            return self._rows(ids) @ h.float()
        return self.linear(h[None].to(COMPUTE_DTYPE))[0, ids].float()

    def dequantize(self) -> torch.Tensor:
        """The matrix the kernels multiply by, as float32 [out, in]."""
        out, inputs = self.shape
        if self.fmt == "q4k":
            return q4k_values(self.data, self.scales)[:, :inputs]
        if self.fmt != "int4":
            return self._rows(torch.arange(out))
        q = unpack_int4(self.data).float().view(out, inputs // GROUP, GROUP)
        scale, zero = self.scales.float().transpose(0, 1).unbind(-1)  # [out, groups] each
        return ((q - 8) * scale[..., None] + zero[..., None]).view(out, inputs)

    @property
    def nbytes(self) -> int:
        return storage_bytes(self.shape, self.fmt, 0)

    def to_bytes(self) -> bytes:
        return _bytes(self.data) + _bytes(self.scales)

    @classmethod
    def from_bytes(
        cls, raw: torch.Tensor, fmt: MatrixFormat, shape: tuple[int, int]
    ) -> QuantizedWeight:
        """Views (no copy) of a stored tensor's bytes, raw: [storage_bytes] uint8."""
        out, inputs = shape
        if fmt in ROW_MATRIX_FORMATS:
            values, _ = row_bytes(fmt, inputs)
            split = out * values
            return cls.from_rows(fmt, raw[:split].view(out, values), raw[split:].view(out, -1))
        if fmt == "q4k":
            split = out // Q4K_OUTPUTS * q4k_blocks_of(inputs) * Q4K_RECORD
            data = raw[:split].view(out // Q4K_OUTPUTS, -1)
            return cls(fmt, shape, data, raw[split:].view(torch.float16).view(data.shape[0], -1))
        split = out * inputs // 2  # int4
        data = raw[:split].view(out, inputs // 2)
        scales = raw[split:].view(COMPUTE_DTYPE).view(inputs // GROUP, out, 2)
        return cls(fmt, shape, data, scales)

    @classmethod
    def from_rows(
        cls, fmt: MatrixFormat, values: torch.Tensor, scales: torch.Tensor
    ) -> QuantizedWeight:
        """Views (no copy) of some rows of a ROW_MATRIX_FORMATS matrix: values [rows, values
        bytes] and scales [rows, scale bytes] uint8, as `row_bytes` gives them."""
        rows = values.shape[0]
        if fmt == "int8":
            shape = (rows, values.shape[1])
            return cls(fmt, shape, values.view(torch.int8), scales.view(COMPUTE_DTYPE).view(rows))
        shape = (rows, values.shape[1] // Q6K_BYTES * K_INPUTS)
        return cls(fmt, shape, values, scales.view(torch.float16))


@dataclass(frozen=True, eq=False)
class QuantizedRows:
    """A 4-bit embedding table, one record per row: `records` [rows, storage / rows] uint8."""

    shape: tuple[int, int]
    records: torch.Tensor

    dtype = COMPUTE_DTYPE

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of these token ids, [n] -> [n, in] bf16."""
        return decode_rows(self.records[ids], self.shape[1])

    @property
    def nbytes(self) -> int:
        return self.records.numel()

    def to_bytes(self) -> bytes:
        return _bytes(self.records)

    @classmethod
    def from_bytes(cls, raw: torch.Tensor, shape: tuple[int, int]) -> QuantizedRows:
        return cls(shape, raw.view(shape[0], -1))


_KERNELS = {
    "int4": native.int4_linear,
    "int8": native.int8_linear,
    "q6k": native.q6k_linear,
    "q4k": native.q4k_linear,
}


def from_q6k_blocks(blocks: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
    """GGUF Q6_K blocks of an [out, in] matrix, blocks: [out, in / 256 * 210] uint8 (a row's
    blocks in order, each ending in its float16 d), as a q6k weight: copies, d apart."""
    out, inputs = shape
    rows = blocks.reshape(out, inputs // K_INPUTS, Q6K_BYTES + 2)
    data = rows[..., :Q6K_BYTES].reshape(out, -1).contiguous()
    d = rows[..., Q6K_BYTES:].contiguous().view(torch.float16).view(out, -1)
    return QuantizedWeight("q6k", shape, data, d)


def q4k_blocks(
    blocks: torch.Tensor, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_K blocks of an [out, in] matrix, blocks: [out, in / 256 * 144] uint8 (a row's
    blocks in order), as their parts: q [out, in] uint8, sc and m [out, in / 256, 8] uint8,
    d and dmin [out, in / 256] float16. A block is its d and dmin, 12 bytes of 6-bit scales
    and minimums (groups 0-3's: the low 6 bits of bytes 0-3 and 4-7; groups 4-7's: their low
    4 bits in bytes 8-11, scale low and minimum high, their top 2 in the top 2 of bytes 0-3
    and 4-7), then 128 bytes of nibbles (each 32 bytes hold two groups of 32 inputs, the
    first in the low nibbles)."""
    out, inputs = shape
    rows = blocks.reshape(out, inputs // K_INPUTS, Q4K_FILE_BYTES)
    dm = rows[..., :4].contiguous().view(torch.float16)  # [out, blocks, 2]
    packed = rows[..., 4:16].to(torch.int32)
    first, second, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat((first & 63, (low & 15) | (first >> 6) << 4), dim=-1)  # [out, blocks, 8]
    m = torch.cat((second & 63, (low >> 4) | (second >> 6) << 4), dim=-1)
    nibbles = rows[..., 16:].reshape(out, -1, 4, 1, 32)
    q = torch.cat((nibbles & 15, nibbles >> 4), dim=3).reshape(out, inputs)
    return q, sc.to(torch.uint8), m.to(torch.uint8), dm[..., 0], dm[..., 1]


def from_q4k_blocks(blocks: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
    """GGUF Q4_K blocks (as `q4k_blocks` takes them) as a q4k weight of the same values."""
    return pack_q4k(*q4k_blocks(blocks, shape))


def pack_q4k(
    q: torch.Tensor,
    sc: torch.Tensor,
    m: torch.Tensor,
    d: torch.Tensor,
    dmin: torch.Tensor,
    inputs: int | None = None,
) -> QuantizedWeight:
    """Q4_K's values as a q4k weight: q [out, blocks * 256] in 0..15, sc and m [out, blocks,
    8] in 0..63, d and dmin [out, blocks] float16; `inputs`: the matrix's own, where the last
    block is padded (default: all of q's). Each 8 outputs' block is one record: for each
    pair of groups c and each 4 inputs t of a group, 32 bytes whose 4 from byte 4o hold
    output o's q of those inputs, group 2c's in the low nibbles and 2c + 1's in the high (a
    vector of 8 outputs, as the kernel multiplies them); then the 8 groups' scales and
    minimums, [group][output] each."""
    out, stored = q.shape
    tasks, blocks = out // Q4K_OUTPUTS, stored // K_INPUTS
    q = q.to(torch.uint8).view(tasks, Q4K_OUTPUTS, blocks, 4, 2, 8, 4)  # [o, b, c, h, t, i]
    nibbles = (q[:, :, :, :, 0] | q[:, :, :, :, 1] << 4).permute(0, 2, 3, 4, 1, 5)
    by_group = [t.view(tasks, Q4K_OUTPUTS, blocks, 8).permute(0, 2, 3, 1) for t in (sc, m)]
    parts = [t.reshape(tasks, blocks, -1) for t in (nibbles, *by_group)]
    records = torch.cat(parts, dim=-1).reshape(tasks, -1).contiguous()
    ds = torch.stack([t.view(tasks, Q4K_OUTPUTS, blocks).transpose(1, 2) for t in (d, dmin)], 2)
    shape = (out, stored if inputs is None else inputs)
    return QuantizedWeight("q4k", shape, records, ds.reshape(tasks, -1).contiguous())


def q4k_values(data: torch.Tensor, ds: torch.Tensor) -> torch.Tensor:
    """A q4k weight's values: data [out / 8, in / 256 * 1152] uint8 and ds [out / 8, in / 256
    * 16] float16 as `pack_q4k` makes them -> [out, in] float32."""
    tasks = data.shape[0]
    records = data.view(tasks, -1, Q4K_RECORD)
    blocks = records.shape[1]
    # [b, c, t, o, i]: pair of groups c, 4 inputs t, output o, input i of the 4
    nibbles = records[..., :Q4K_NIBBLES].view(tasks, blocks, 4, 8, Q4K_OUTPUTS, 4)
    q = torch.stack((nibbles & 15, nibbles >> 4), dim=3)  # [b, c, h, t, o, i]
    q = q.permute(0, 5, 1, 2, 3, 4, 6).reshape(tasks * Q4K_OUTPUTS, blocks, 8, 32).float()
    per_group = 8 * Q4K_OUTPUTS  # bytes of the scales, then of the minimums
    sc, m = (
        records[..., at : at + per_group].view(tasks, blocks, 8, Q4K_OUTPUTS).permute(0, 3, 1, 2)
        for at in (Q4K_NIBBLES, Q4K_NIBBLES + per_group)
    )  # [tasks, o, b, group] each
    d, dmin = ds.view(tasks, blocks, 2, Q4K_OUTPUTS).permute(2, 0, 3, 1).reshape(2, -1, blocks, 1)
    step = (d.float() * sc.reshape(-1, blocks, 8).float())[..., None]
    floor = (dmin.float() * m.reshape(-1, blocks, 8).float())[..., None]
    return (step * q - floor).reshape(tasks * Q4K_OUTPUTS, blocks * K_INPUTS)


def q6k_values(data: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q6k rows' values: data [n, in / 256 * 208] uint8, d [n, in / 256] f16 -> [n, in] float32.
    Per half block (128 inputs): 32 bytes of low nibbles give inputs 0-31 and (their high
    nibbles) 64-95, the next 32 give 32-63 and 96-127; the half's 32 bytes of high bits hold
    bit pairs 0, 2, 4, 6 of those four runs; each 16 inputs have their own int8 scale."""
    n, blocks = d.shape
    rows = data.view(n, blocks, Q6K_BYTES)
    low = rows[..., :128].reshape(n, blocks, 2, 2, 32)  # [half, run, byte]
    high = rows[..., 128:192].reshape(n, blocks, 2, 1, 32)
    nibbles = torch.stack((low & 15, low >> 4), dim=4)  # [half, run, nibble, byte]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(2, 2).T.reshape(1, 1, 1, 2, 2, 1)
    pairs = (high.unsqueeze(3) >> shifts) & 3  # run r, nibble h: bits 2 * (2h + r)
    q = (nibbles | pairs << 4).transpose(3, 4).reshape(n, blocks, 16, 16).float() - 32
    sc = rows[..., 192:208].view(torch.int8).float()  # [n, blocks, 16]
    values = q * (d.float()[..., None] * sc)[..., None]
    return values.reshape(n, blocks * K_INPUTS)


_bf16_values: weakref.WeakKeyDictionary[QuantizedWeight, torch.Tensor] = weakref.WeakKeyDictionary()


def bf16_values(weight: QuantizedWeight) -> torch.Tensor:
    """A k-quant weight's values as a bf16 matrix, for torch's dense kernels where ours are absent:
    made once per weight (a streamed layer's, once per pass)."""
    values = _bf16_values.get(weight)
    if values is None:
        values = weight.dequantize().to(COMPUTE_DTYPE)
        _bf16_values[weight] = values
    return values


def dense_values(weight: torch.Tensor | QuantizedWeight | QuantizedRows) -> torch.Tensor:
    """A weight as a plain tensor: itself if dense, else the values its format stores."""
    if isinstance(weight, torch.Tensor):
        return weight
    if isinstance(weight, QuantizedRows):
        return weight[torch.arange(weight.shape[0])]
    return weight.dequantize()


def decode_rows(records: torch.Tensor, inputs: int) -> torch.Tensor:
    """int4rows records [n, bytes per row] uint8 -> their values [n, inputs] bf16."""
    n = records.shape[0]
    nibbles = records[:, : inputs // 2]
    q = torch.stack((nibbles & 15, nibbles >> 4), dim=-1).view(n, inputs // GROUP, GROUP)
    scales = records[:, inputs // 2 :].contiguous().view(COMPUTE_DTYPE).view(n, -1, 2)
    values = (q.float() - 8) * scales[..., :1].float() + scales[..., 1:].float()
    return values.view(n, inputs).to(COMPUTE_DTYPE)


def from_groups(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: Literal["int4", "int4rows"]
) -> QuantizedWeight | QuantizedRows:
    """4-bit values q [out, in] in 0..15 with per-group scale and zero [out, in / GROUP]
    (w = (q - 8) * scale + zero) in either 4-bit format."""
    out, inputs = q.shape
    pairs = torch.stack((scale, zero), dim=-1).to(COMPUTE_DTYPE)  # [out, groups, 2]
    if fmt == "int4rows":
        nibbles = (q[:, 0::2] | q[:, 1::2] << 4).to(torch.uint8)
        records = torch.cat((nibbles, pairs.view(out, -1).view(torch.uint8)), dim=1)
        return QuantizedRows((out, inputs), records.contiguous())
    data = pack_int4(q)
    return QuantizedWeight("int4", (out, inputs), data, pairs.transpose(0, 1).contiguous())


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """4-bit values q [out, in] in 0..15 -> [out, in / 2] uint8, packed in blocks of native.BLOCK_N
    outputs (the last may be shorter), input after input; in a block of b outputs, byte j of
    an input holds output j in its low nibble and output j + b / 2 in its high one."""
    out, inputs = q.shape
    q = q.to(torch.uint8)
    parts = []
    for start in range(0, out, native.BLOCK_N):
        block = q[start : start + native.BLOCK_N]
        half = len(block) // 2
        parts.append((block[:half] | block[half:] << 4).T.reshape(-1))  # [in, half]
    return torch.cat(parts).view(out, inputs // 2)


def unpack_int4(data: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s inverse: [out, in / 2] uint8 -> q [out, in] uint8."""
    out, inputs = data.shape[0], data.shape[1] * 2
    flat, parts = data.reshape(-1), []
    for start in range(0, out, native.BLOCK_N):
        half = min(native.BLOCK_N, out - start) // 2
        pairs = flat[start * inputs // 2 : (start + 2 * half) * inputs // 2].view(inputs, half)
        parts.append(torch.cat((pairs & 15, pairs >> 4), dim=1).T)  # [2 * half, in]
    return torch.cat(parts)


@functools.cache
def torch_packs_as_we_do(out: int) -> bool:
    """Whether torch's CPU int4 packing of `out` outputs on this CPU is `pack_int4`'s (it is
    where torch has AVX-512; with AVX2 it packs 32 outputs at a time)."""
    q = torch.randint(0, 16, (out, 2 * 16 * PACK_TILES), generator=torch.Generator().manual_seed(0))
    theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), PACK_TILES)
    return torch.equal(theirs.view(torch.uint8).reshape(-1), pack_int4(q).reshape(-1))


_torch_packings: weakref.WeakKeyDictionary[QuantizedWeight, torch.Tensor] = (
    weakref.WeakKeyDictionary()
)


def torch_packing(weight: QuantizedWeight) -> torch.Tensor:
    """An int4 weight's values in torch's CPU packing on this CPU: a copy, made once per weight
    (a streamed layer's, once per pass)."""
    packed = _torch_packings.get(weight)
    if packed is None:
        q = unpack_int4(weight.data).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, PACK_TILES)
        _torch_packings[weight] = packed
    return packed


def quantize_int4(
    w: torch.Tensor, fmt: Literal["int4", "int4rows"] = "int4"
) -> QuantizedWeight | QuantizedRows:
    """Round to nearest, asymmetric, per group of GROUP inputs: each group's range in 16 steps."""
    out, inputs = w.shape
    groups = w.float().view(out, inputs // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = groups - low[..., None]
    q = q.div_(scale[..., None]).round_().clamp_(0, 15).view(out, inputs)  # in place: one copy
    q = q.to(torch.uint8)  # the float copy goes before the packing makes its own
    return from_groups(q, scale, low + 8 * scale, fmt)


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Round to nearest, symmetric, one scale per output row."""
    w = w.float()
    scale = (w.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # in place: one copy
    return QuantizedWeight("int8", tuple(w.shape), q, scale.to(COMPUTE_DTYPE))  # type: ignore[arg-type]


def _probe(fmt: str, n_out: int, n_in: int):
    """row_blocks' cancelling probe, its weight quantized to `fmt`, on torch's kernel: the
    only one row blocks guard (the probe's narrower weight may fit ours where the weight it
    stands for does not)."""
    x, weight = row_blocks.probe_inputs(COMPUTE_DTYPE, row_blocks.probe_features(n_out, n_in), n_in)
    quantized = quantize_int4(weight) if fmt == "int4" else quantize_int8(weight)
    assert isinstance(quantized, QuantizedWeight)  # int4, not int4rows
    return x, quantized._on_torch


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()
