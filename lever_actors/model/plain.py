"""Our kernels without torch: csrc/plain.cpp, the same headers as the torch ops of
model/native.py built as a plain C library (OpenMP for threads, no torch headers) and called
through ctypes on numpy arrays, so they give the same bits. The first step of the native decode
path (#63): a process that imports this imports numpy, not torch.

bf16 and float16 arrays are numpy uint16 arrays of their bits (numpy has no bf16). The library
builds once per machine into the cache (model/kernel_build.py) for AVX512-VNNI or AVX2; on a
CPU with AMX it takes the AVX512-VNNI build, whose sums are the tiles' integers.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
from pathlib import Path

import numpy as np

from lever_actors.errors import LeverError
from lever_actors.model import kernel_build
from lever_actors.model.kernel_build import AVX2, AVX512_VNNI, CSRC

SOURCE = CSRC / "plain.cpp"
ABI = 1  # csrc/plain.cpp's lever_plain_abi()
Q4K_OUTPUTS, Q4K_RECORD, K_INPUTS = 8, 1152, 256  # csrc/q4k.h

_BF16 = np.uint16  # numpy's stand-in for bf16 and float16: their bits
_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_f64 = ctypes.c_double
_SIGNATURES = {  # name -> argument types (csrc/plain.cpp)
    "lever_q4k": (_p, _i64, _i64, _p, _p, _i64, _i64, _p, _p),
    "lever_q6k": (_p, _i64, _i64, _p, _p, _i64, _p, _p),
    "lever_int8": (_p, _i64, _i64, _p, _p, _i64, _p, _p),
    "lever_rms_norm": (_p, _i64, _i64, _p, _f64, _p),
    "lever_rope": (_p, _i64, _i64, _i64, _i64, _i64, _p, _p, _p),
    "lever_attend": (_p, _i64, _i64, _i64, _p, _p, _i64, _i64, _i64, _p, _f64, _f64, _p),
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


def q4k_linear(
    x: np.ndarray, records: np.ndarray, ds: np.ndarray, bias: np.ndarray | None = None
) -> np.ndarray:
    """x [m, in] bf16 times a q4k matrix: records [n / 8, k / 256 * 1152] uint8, ds [n / 8,
    k / 256 * 16] float16, k being `in` rounded up to whole blocks -> [m, n] bf16."""
    x = _rows(x)
    tasks, k = records.shape[0], records.shape[1] // Q4K_RECORD * K_INPUTS
    if not 0 <= k - x.shape[1] < K_INPUTS or ds.size != tasks * k // K_INPUTS * 16:
        raise ValueError(f"q4k shapes: x {x.shape}, records {records.shape}, ds {ds.shape}")
    out = np.empty((x.shape[0], tasks * Q4K_OUTPUTS), _BF16)
    library().lever_q4k(
        _at(x), x.shape[0], x.shape[1], _at(records), _at(ds), tasks, k, _at(bias), _at(out)
    )
    return out


def q6k_linear(
    x: np.ndarray, data: np.ndarray, d: np.ndarray, bias: np.ndarray | None = None
) -> np.ndarray:
    """x [m, k] bf16 times a q6k matrix: data [n, k / 256 * 208] uint8, d [n, k / 256]
    float16 -> [m, n] bf16."""
    x = _rows(x)
    (n, _), k = data.shape, x.shape[1]
    if k % K_INPUTS or data.shape[1] != k // K_INPUTS * 208 or d.size != n * (k // K_INPUTS):
        raise ValueError(f"q6k shapes: x {x.shape}, data {data.shape}, d {d.shape}")
    out = np.empty((x.shape[0], n), _BF16)
    library().lever_q6k(_at(x), x.shape[0], k, _at(data), _at(d), n, _at(bias), _at(out))
    return out


def int8_linear(
    x: np.ndarray, weight: np.ndarray, scales: np.ndarray, bias: np.ndarray | None = None
) -> np.ndarray:
    """x [m, k] bf16 times an int8 matrix [n, k] with row scales [n] bf16 -> [m, n] bf16."""
    x = _rows(x)
    n, k = weight.shape
    if k != x.shape[1] or k % 32 or n % 8 or scales.size != n:
        raise ValueError(f"int8 shapes: x {x.shape}, weight {weight.shape}, scales {scales.shape}")
    out = np.empty((x.shape[0], n), _BF16)
    library().lever_int8(_at(x), x.shape[0], k, _at(weight), _at(scales), n, _at(bias), _at(out))
    return out


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
