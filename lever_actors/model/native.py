"""Our kernels for the 4- and 8-bit matrices, as the model code calls them: which matrices,
attention, norms and rotations they take, and the ops themselves. model/native_build.py
builds them for this CPU (csrc/amx.cpp on a CPU with AMX, csrc/avx2.cpp on one with AVX2 and
FMA, with AVX512-VNNI's byte products where the CPU has them) and loads them as torch ops;
they are used for every int4 and int8 matrix they fit.

torch's weight-only kernels cost about as much per row as one-token decoding, so a tree of
64 nodes costs nearly 64 passes, and they round a row differently by how many rows share the
call. Ours unpack each weight once per call, multiply every row by it, and compute each row on
its own by construction: a tree costs a fraction of its rows' passes and equals one-token
decoding bit for bit (docs/design.md, "Kernels").
They are the default where they load; `LEVER_ACTORS_KERNELS=torch` keeps torch's kernels.
Where they cannot load (model/native_build.py says why, once), torch's kernels stay in use.
"""

from __future__ import annotations

import functools
import os
from enum import Enum

import torch

from lever_actors.logs import get_logger
from lever_actors.model.formats import K_FORMATS, K_INPUTS
from lever_actors.model.native_build import AMX, Isa, loaded, ops

log = get_logger(__name__)

BLOCK_N = 64  # outputs per block of the kernels (the int4 packing's blocks)
DEPTH = 32  # inputs per step of the kernels (AMX: one tile product)


class Kernels(Enum):
    NATIVE = "native"  # ours, where this machine can build and run them (the default)
    TORCH = "torch"  # torch's weight-only kernels everywhere


@functools.cache
def in_use() -> Isa | None:
    """The kernels this process uses: None where torch's are asked for or ours cannot load."""
    return loaded() if requested() is Kernels.NATIVE else None


def fits(fmt: str, shape: tuple[int, int]) -> bool:
    """Whether a matrix of this format and [out, in] shape runs on our kernels."""
    out, inputs = shape
    return (
        fmt in ("int4", "int8", *K_FORMATS)
        and out % BLOCK_N == 0
        and inputs % (K_INPUTS if fmt == "q6k" else DEPTH) == 0  # q4k pads its last block
        and in_use() is not None
    )


def fewest_rows(fmt: str) -> int:
    """The fewest rows a draft's matrix of `fmt` sends to our kernels (see Isa.fewest_rows;
    torch has no kernel for the k-quants, so they always take ours)."""
    isa = in_use()
    return 1 if isa is None or fmt in K_FORMATS else isa.fewest_rows


# Every product below takes an optional bias [out] bf16, added in its call as torch's bf16 add
# rounds it (csrc/common.h, `biased`).


def int4_linear(
    x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, bias=None
) -> torch.Tensor:
    """x [n, in] bf16 times an int4 matrix in the layout's packing -> [n, out] bf16."""
    return _ops().int4_linear(x.contiguous(), data, scales, bias)


def int8_linear(
    x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, bias=None
) -> torch.Tensor:
    """x [n, in] bf16 times an int8 matrix [out, in] with row scales -> [n, out] bf16."""
    isa = _isa()
    if isa is AMX:
        pairs = x.contiguous().view(torch.int32).T.contiguous()  # [in / 2, n]: the tiles' layout
        return ops(isa).int8_linear(pairs, x.shape[0], data, scales, bias)
    return ops(isa).int8_linear(x.contiguous(), data, scales, bias)


def q6k_linear(x: torch.Tensor, data: torch.Tensor, d: torch.Tensor, bias=None) -> torch.Tensor:
    """x [n, in] bf16 times a q6k matrix (GGUF's Q6_K blocks) -> [n, out] bf16."""
    return _ops().q6k_linear(x.contiguous(), data, d, bias)


def q4k_linear(x: torch.Tensor, records: torch.Tensor, ds: torch.Tensor, bias=None) -> torch.Tensor:
    """x [n, in] bf16 times a q4k matrix (GGUF's Q4_K values in our records) -> [n, out] bf16."""
    return _ops().q4k_linear(x.contiguous(), records, ds, bias)


ATTEND_GROUP = 8  # the most query heads per kv head our attention takes


def attends(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether our attention takes these queries [H, n, hd] and keys [KV, T, hd]: bf16, hd a
    multiple of 8, at most ATTEND_GROUP query heads per kv head."""
    heads, kv, hd = q.shape[0], keys.shape[0], q.shape[-1]
    fits = hd % 8 == 0 and heads % kv == 0 and heads // kv <= ATTEND_GROUP
    return q.dtype == torch.bfloat16 and fits and in_use() is not None


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [H, n, hd] bf16, keys/values [KV, T, hd] bf16, mask [n, T] (True: attend) or None
    -> [n, H, hd] bf16, each row from its own query and visible keys alone, in float32."""
    mask = mask.contiguous() if mask is not None else None
    return _ops().attend(q.contiguous(), keys, values, mask, scale, softcap or 0.0)


def normalizes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether our RMS norm takes these rows [..., d] and weight [d]: both bf16."""
    return x.dtype == weight.dtype == torch.bfloat16 and in_use() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] bf16 -> weight * x / sqrt(mean(x^2) + eps), each row alone (csrc/norm.h)."""
    return _ops().rms_norm(x.contiguous(), weight.contiguous(), eps)


def rotates(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether our rotary embedding takes these heads [H, n, hd] and tables [n, hd]: bf16."""
    return x.dtype == cos.dtype == torch.bfloat16 and x.stride(-1) == 1 and in_use() is not None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [H, n, hd] bf16 (strided in H and n) -> the same rotated, contiguous, rounded as
    model/rope.py's torch code rounds it (csrc/rope.h)."""
    return _ops().rope(x, cos.contiguous(), sin.contiguous())


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [n] int64, inv_freq [hd / 2] float32 -> cos, sin [n, hd] bf16 (csrc/rope.h)."""
    return _ops().rope_tables(positions, inv_freq)


def gates(gate: torch.Tensor) -> bool:
    """Whether our SwiGLU takes this gate: bf16."""
    return gate.dtype == torch.bfloat16 and in_use() is not None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., f] bf16 -> bf16(bf16(silu(gate)) * up), element by element in one fixed
    sequence (csrc/activation.h), which the plain kernels repeat without torch."""
    return _ops().swiglu(gate, up)


def decoder_layer(x, norms, matrices, formats, biases, cache, at, place, shape, softcap):
    """One decoder layer in one call (csrc/layer.h; model/fused.py builds the arguments):
    x [n, d] bf16; cache: (keys, values, slot positions); at: (layer, committed length, span);
    shape: (heads, head dim, norm eps, attention scale) -> x after the layer."""
    layer, length, span = at
    heads, head_dim, eps, scale = shape
    return _ops().decoder_layer(
        x, norms, matrices, formats, *biases, *cache, layer, length, span,
        place.offsets, place.positions, place.cos.contiguous(), place.sin.contiguous(), place.mask,
        heads, head_dim, eps, scale, softcap,
    )  # fmt: skip


def requested() -> Kernels:
    value = os.environ.get("LEVER_ACTORS_KERNELS", Kernels.NATIVE.value)
    try:
        return Kernels(value)
    except ValueError:
        choices = ", ".join(k.value for k in Kernels)
        log.warning("unknown LEVER_ACTORS_KERNELS; using ours", value=value, choices=choices)
        return Kernels.NATIVE


def _ops():
    return ops(_isa())


def _isa() -> Isa:
    isa = loaded()
    if isa is None:
        raise RuntimeError("our kernels did not load on this machine")
    return isa
