"""Our kernels without torch: csrc/plain.cpp, the same headers as the torch ops of
model/native.py built as a plain C library (OpenMP for threads, no torch headers) and called
through ctypes on numpy arrays, so they give the same bits: the plain path's arithmetic
(#63). A process that imports this imports numpy, not torch.

bf16 and float16 arrays are numpy uint16 arrays of their bits (numpy has no bf16). The library
builds once per machine into the cache (model/kernel_build.py) for AVX512-VNNI or AVX2; on a
CPU with AMX it takes the AVX512-VNNI build, whose sums are the tiles' integers.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from lever_actors.errors import LeverError
from lever_actors.model import kernel_build
from lever_actors.model.formats import (
    FORMAT_CODES,
    GROUP,
    K_INPUTS,
    LAYER_MATRICES,
    Q4K_OUTPUTS,
    Q4K_RECORD,
    Q6K_BYTES,
)
from lever_actors.model.kernel_build import AVX2, AVX512_VNNI, CSRC
from lever_actors.threads import settle_policy

SOURCE = CSRC / "plain.cpp"
ABI = 4  # csrc/plain.cpp's lever_plain_abi()

_BF16 = np.uint16  # numpy's stand-in for bf16 and float16: their bits
_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_f64 = ctypes.c_double
_SIGNATURES = {  # name -> argument types (csrc/plain.cpp)
    "lever_linear": (_p, _p, _i64, _p, _p),
    "lever_rms_norm": (_p, _i64, _i64, _p, _f64, _p),
    "lever_rope": (_p, _i64, _i64, _i64, _i64, _i64, _p, _p, _p),
    "lever_attend": (_p, _i64, _i64, _i64, _p, _p, _i64, _i64, _i64, _p, _f64, _f64, _p),
    "lever_swiglu": (_p, _p, _i64, _p),
    "lever_rope_tables": (_p, _i64, _p, _i64, _p, _p),
    "lever_decoder_layer": (_p, _i64, _i64, _p, _p, _p, _p, _p),
}


class KernelsUnavailable(LeverError):
    """This machine cannot build or load the plain kernels (the message says why)."""


@functools.cache
def library() -> ctypes.CDLL:
    """The plain kernels for this CPU, built once per machine; KernelsUnavailable if not."""
    isa, why = kernel_build.supported((AVX512_VNNI, AVX2))
    if isa is None:
        raise KernelsUnavailable(f"no plain kernels: {why}")
    flags = kernel_build.flags(isa)
    path = kernel_build.library_path(f"plain-{isa.name}", SOURCE, flags)
    settle_policy()  # OpenMP loads with the library
    try:
        built = kernel_build.built(path, functools.partial(_compile, flags), f"plain {isa.name}")
        lib = ctypes.CDLL(str(built))
    except subprocess.CalledProcessError as error:
        raise KernelsUnavailable(kernel_build.build_failure(isa, error)) from None
    except OSError as error:
        raise KernelsUnavailable(f"loading the plain kernels failed: {error}") from None
    if lib.lever_plain_abi() != ABI:
        raise KernelsUnavailable(f"{built} has ABI {lib.lever_plain_abi()}, not {ABI}")
    for name, arguments in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = arguments, None
    return lib


def available() -> bool:
    """Whether this machine runs the plain kernels (building them once if need be)."""
    try:
        library()
    except KernelsUnavailable:
        return False
    return True


def _compile(flags: tuple[str, ...], out: Path) -> None:
    kernel_build.run(["g++", *flags, "-fopenmp", "-shared", str(SOURCE), "-o", str(out)])


def _at(array: np.ndarray | None) -> int | None:
    """The address of a contiguous array's first element (None: a null pointer)."""
    if array is None:
        return None
    assert array.flags.c_contiguous, "the kernels take contiguous arrays"
    return array.ctypes.data


def _rows(x: np.ndarray) -> np.ndarray:
    if x.ndim != 2 or x.dtype != _BF16:
        raise ValueError(f"x: [rows, inputs] bf16 bits (uint16), not {x.dtype} {x.shape}")
    return np.ascontiguousarray(x)


@dataclass(frozen=True)
class Matrix:
    """A quantized [out, in] matrix as model/quantized.py keeps it, in numpy arrays: int4
    [out, in / 2] uint8 and [in / 32, out, 2] bf16; int8 [out, in] int8 and [out] bf16; q6k
    [out, in / 256 * 208] uint8 and [out, in / 256] float16; q4k [out / 8, blocks * 1152]
    uint8 and [out / 8, blocks * 16] float16."""

    fmt: str  # a key of FORMAT_CODES
    shape: tuple[int, int]
    data: np.ndarray
    scales: np.ndarray


class _Matrix(ctypes.Structure):
    _fields_ = [("fmt", _i64), ("data", _p), ("scales", _p), ("out", _i64), ("in_", _i64)]


def linear(x: np.ndarray, m: Matrix, bias: np.ndarray | None = None) -> np.ndarray:
    """x [rows, in] bf16 times the quantized matrix m [out, in] (+ bias [out] bf16) -> [rows,
    out] bf16 (csrc/products.h)."""
    x = _rows(x)
    out_features, inputs = m.shape
    if x.shape[1] != inputs:
        raise ValueError(f"{m.fmt} {m.shape} cannot multiply x {x.shape}")
    _check_matrix(m)
    out = np.empty((x.shape[0], out_features), _BF16)
    matrix = _Matrix(FORMAT_CODES[m.fmt], _at(m.data), _at(m.scales), out_features, inputs)
    library().lever_linear(ctypes.byref(matrix), _at(x), x.shape[0], _at(bias), _at(out))
    return out


# each format's (outputs, inputs) multiples the kernels take (csrc/products.h)
_MULTIPLES = {"int4": (64, GROUP), "int8": (8, GROUP), "q6k": (8, K_INPUTS), "q4k": (8, GROUP)}


def _check_matrix(m: Matrix) -> None:
    """ValueError unless the kernels take m's format and shape and its arrays have the
    format's sizes (model/quantized.py's layouts)."""
    out, inputs = m.shape
    if m.fmt not in _MULTIPLES:
        raise ValueError(f"the plain kernels multiply {', '.join(_MULTIPLES)}, not {m.fmt}")
    outputs, grouped = _MULTIPLES[m.fmt]
    if out % outputs or inputs % grouped:
        raise ValueError(f"{m.fmt} needs outputs in {outputs}s and inputs in {grouped}s: {m.shape}")
    blocks = -(-inputs // K_INPUTS)  # q4k pads a last block
    data, scales = {
        "int4": ((out, inputs // 2), (inputs // GROUP, out, 2)),
        "int8": ((out, inputs), (out,)),
        "q6k": ((out, inputs // K_INPUTS * Q6K_BYTES), (out, inputs // K_INPUTS)),
        "q4k": ((out // Q4K_OUTPUTS, blocks * Q4K_RECORD), (out // Q4K_OUTPUTS, blocks * 16)),
    }[m.fmt]
    if m.data.size != np.prod(data) or m.scales.size != np.prod(scales):
        raise ValueError(f"{m.fmt} {m.shape}: data {m.data.shape}, scales {m.scales.shape}")


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [..., d] bf16 -> weight * x / sqrt(mean(x^2) + eps), each row alone (csrc/norm.h)."""
    x = np.ascontiguousarray(x)
    d = x.shape[-1]
    out = np.empty_like(x)
    library().lever_rms_norm(_at(x), x.size // d if d else 0, d, _at(weight), eps, _at(out))
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [H, n, hd] bf16 (any strides, unit in hd), cos, sin [n, hd] -> the same rotated,
    contiguous (csrc/rope.h)."""
    heads, n, hd = x.shape
    item = x.itemsize
    if x.strides[2] != item or hd % 2:
        raise ValueError(f"rope: x [H, n, hd] with unit stride in an even hd, not {x.strides}")
    out = np.empty((heads, n, hd), _BF16)
    library().lever_rope(
        x.ctypes.data, heads, n, hd, x.strides[0] // item, x.strides[1] // item,
        _at(cos), _at(sin), _at(out),
    )  # fmt: skip
    return out


def attend(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    mask: np.ndarray | None,
    scale: float,
    softcap: float | None,
) -> np.ndarray:
    """q [H, n, hd] bf16, keys/values [KV, T, hd] bf16, mask [n, T] bool (True: attend) or
    None -> [n, H, hd] bf16, each row from its own query and visible keys (csrc/attention.h)."""
    q = np.ascontiguousarray(q)
    heads, n, hd = q.shape
    kv, length, _ = keys.shape
    item = keys.itemsize
    if keys.strides != values.strides or keys.strides[1:] != (hd * item, item):
        raise ValueError("attend: keys and values [KV, T, hd], each head's rows contiguous")
    if heads % kv or heads // kv > 8 or hd % 8 or length == 0:
        raise ValueError(f"attend shapes: q {q.shape}, keys {keys.shape}")
    if mask is not None:
        mask = np.ascontiguousarray(mask, dtype=np.bool_)
    out = np.empty((n, heads, hd), _BF16)
    library().lever_attend(
        _at(q), heads, n, hd, keys.ctypes.data, values.ctypes.data, kv, length,
        keys.strides[0] // item, _at(mask), scale, softcap or 0.0, _at(out),
    )  # fmt: skip
    return out


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """positions [n] int64, inv_freq [hd / 2] float32 (model/frequencies.py) -> cos, sin
    [n, hd] bf16 (csrc/rope.h)."""
    positions = np.ascontiguousarray(positions, np.int64)
    inv_freq = np.ascontiguousarray(inv_freq, np.float32)
    n, half = positions.shape[0], inv_freq.shape[0]
    cos, sin = np.empty((n, 2 * half), _BF16), np.empty((n, 2 * half), _BF16)
    library().lever_rope_tables(_at(positions), n, _at(inv_freq), half, _at(cos), _at(sin))
    return cos, sin


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gate, up [..., f] bf16 -> bf16(bf16(silu(gate)) * up) (csrc/activation.h)."""
    gate, up = np.ascontiguousarray(gate), np.ascontiguousarray(up)
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {gate.shape} and up {up.shape} differ")
    out = np.empty_like(gate)
    library().lever_swiglu(_at(gate), _at(up), gate.size, _at(out))
    return out


# ---- one decoder layer in one call (csrc/layer.h) ----


@dataclass(frozen=True)
class Layer:
    """A plain pre-norm layer's weights: norms [d] bf16, the LAYER_MATRICES in order, and
    the biases or None."""

    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    matrices: tuple[Matrix, ...]
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None

    @functools.cached_property
    def struct(self) -> _LayerWeights:
        """csrc/layer.h's LayerWeights of these arrays, checked and built once: built for
        every call, the real target's 28 took 3.5 ms of a one-token pass's 40-45."""
        for m in self.matrices:
            _check_matrix(m)
        matrices = (_Matrix * len(LAYER_MATRICES))(
            *(
                _Matrix(FORMAT_CODES[m.fmt], _at(m.data), _at(m.scales), *m.shape)
                for m in self.matrices
            )
        )
        return _LayerWeights(
            _at(self.attn_norm),
            _at(self.ffn_norm),
            matrices,
            _at(self.bq),
            _at(self.bk),
            _at(self.bv),
        )


@dataclass(frozen=True)
class Rows:
    """Where a call's n rows go (model/placement.py's Placement, in numpy): each row's position
    [n] int64, cos and sin [n, hd] bf16, its pending slot [n] int64 (None: 0..n-1), the mask
    [n, length + span] bool (None: all), and how many pending slots attention sees."""

    positions: np.ndarray
    cos: np.ndarray
    sin: np.ndarray
    offsets: np.ndarray | None
    mask: np.ndarray | None
    span: int


@dataclass(frozen=True)
class Shape:
    heads: int
    head_dim: int
    eps: float
    scale: float
    softcap: float

    @functools.cached_property
    def struct(self) -> _LayerShape:
        """csrc/layer.h's LayerShape, built once."""
        return _LayerShape(self.heads, self.head_dim, self.eps, self.scale, self.softcap)


class _LayerWeights(ctypes.Structure):
    _fields_ = [
        ("attn_norm", _p),
        ("ffn_norm", _p),
        ("matrices", _Matrix * len(LAYER_MATRICES)),
        ("bq", _p),
        ("bk", _p),
        ("bv", _p),
    ]


class _LayerCache(ctypes.Structure):
    _fields_ = [
        ("keys", _p),
        ("values", _p),
        ("slot_positions", _p),
        ("kv_heads", _i64),
        ("capacity", _i64),
    ]


class _LayerPlace(ctypes.Structure):
    _fields_ = [
        ("layer", _i64),
        ("length", _i64),
        ("span", _i64),
        ("offsets", _p),
        ("positions", _p),
        ("cos", _p),
        ("sin", _p),
        ("mask", _p),
    ]


class _LayerShape(ctypes.Structure):
    _fields_ = [("heads", _i64), ("hd", _i64), ("eps", _f64), ("scale", _f64), ("softcap", _f64)]


class Cache(Protocol):
    """A KV cache as the layer writes it: keys, values [L, KV, capacity, hd] bf16, each slot's
    position [capacity] int64 (model/plain_model.py's KVCache)."""

    keys: np.ndarray
    values: np.ndarray
    positions: np.ndarray


def decoder_layer(
    x: np.ndarray, w: Layer, cache: Cache, layer: int, length: int, rows: Rows, shape: Shape
) -> np.ndarray:
    """x [n, d] bf16 -> the same after layer `layer`, its k and v written into the cache's
    pending slots after the committed `length` (csrc/layer.h)."""
    x = _rows(x)
    _, kv, capacity, _ = cache.keys.shape
    if length + rows.span > capacity:
        raise ValueError(f"the cache holds {capacity} slots, not {length + rows.span}")
    room = _LayerCache(_at(cache.keys), _at(cache.values), _at(cache.positions), kv, capacity)
    place = _LayerPlace(
        layer, length, rows.span, _at(rows.offsets), _at(rows.positions),
        _at(rows.cos), _at(rows.sin), _at(rows.mask),
    )  # fmt: skip
    out = np.empty_like(x)
    library().lever_decoder_layer(
        _at(x), x.shape[0], x.shape[1], ctypes.byref(w.struct), ctypes.byref(room),
        ctypes.byref(place), ctypes.byref(shape.struct), _at(out),
    )  # fmt: skip
    return out
