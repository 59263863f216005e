"""Our kernels for the 4- and 8-bit matrices: csrc/amx.cpp on a CPU with AMX, csrc/avx2.cpp on
one with AVX2 and FMA (with AVX512-VNNI's byte products where the CPU has them). Built once
per machine with the system's C++ compiler into the cache (stamped with the library's size
and hash, and rebuilt where the file does not match), loaded as torch ops, used for every
int4 and int8 matrix they fit.

torch's weight-only kernels cost about as much per row as one-token decoding, so a tree of
64 nodes costs nearly 64 passes, and they round a row differently by how many rows share the
call. Ours unpack each weight once per call, multiply every row by it, and compute each row on
its own by construction: a tree costs a fraction of its rows' passes and equals one-token
decoding bit for bit (docs/design.md, "Kernels").
They are the default where they load; `LEVER_ACTORS_KERNELS=torch` keeps torch's kernels.
Where a CPU has neither instruction set, no compiler is found or the build fails, torch's
kernels stay in use, and the reason is logged once.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from lever_actors.logs import get_logger
from lever_actors.paths import default_cache_dir, exclusive

log = get_logger(__name__)

BLOCK_N = 64  # outputs per block of the kernels (the int4 packing's blocks)
DEPTH = 32  # inputs per step of the kernels (AMX: one tile product)
K_INPUTS = 256  # inputs per block of GGUF's k-quants (Q4_K, Q6_K)
Q4K_OUTPUTS = 8  # outputs per record of the q4k packing
K_FORMATS = ("q4k", "q6k")  # GGUF's Q4_K and Q6_K values as we keep them: torch has no kernel


@dataclass(frozen=True)
class Isa:
    """One instruction set's kernels: their source, what the CPU must list, how to build them."""

    name: str  # what logs and results call it, and its built library's stem
    stem: str  # the source's stem and the ops' namespace, lever_<stem>
    cpu_flags: tuple[str, ...]
    compile_flags: tuple[str, ...]
    # below this many rows torch's kernels are faster; only a matrix whose rows need not round
    # as alone (a draft's) may switch kernel by rows
    fewest_rows: int

    @property
    def source(self) -> Path:
        return Path(__file__).parent / "csrc" / f"{self.stem}.cpp"

    @property
    def headers(self) -> tuple[Path, ...]:
        """Every header beside the sources: each keys the built library, so that a changed or
        new header rebuilds it."""
        return tuple(sorted(self.source.parent.glob("*.h")))

    @property
    def ops(self):
        return getattr(torch.ops, f"lever_{self.stem}")


# in order of preference. AMX: torch's kernels are faster below 8 rows (one int8 row of the
# real target's largest matrices 0.6 ms on torch's, 1.0-2.1 on the tiles); AVX2: ours are the
# faster at every row count (docs/design.md, "Kernels"). AVX512-VNNI (AMD's Zen 4) is the AVX2
# source with one instruction for four byte products where it had two (csrc/common.h)
AMX_ISA = (
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512bf16",
    "avx512vnni",
    "fma",
    "f16c",
    "amx-tile",
    "amx-bf16",
    "amx-int8",
)
AMX = Isa(
    "amx",
    "amx",
    (
        "amx_tile",
        "amx_bf16",
        "amx_int8",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_bf16",
        "avx512_vnni",
        "f16c",
    ),
    tuple(f"-m{isa}" for isa in AMX_ISA),
    fewest_rows=8,
)
AVX2 = Isa("avx2", "avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"), fewest_rows=1)
VNNI_ISA = ("avx512f", "avx512bw", "avx512vl", "avx512vnni")
AVX512_VNNI = Isa(
    "avx512-vnni",
    "avx2",
    (*AVX2.cpu_flags, "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    (*AVX2.compile_flags, *(f"-m{isa}" for isa in VNNI_ISA)),
    fewest_rows=1,
)
ISAS = (AMX, AVX512_VNNI, AVX2)


class Kernels(Enum):
    NATIVE = "native"  # ours, where this machine can build and run them (the default)
    TORCH = "torch"  # torch's weight-only kernels everywhere


_lock = threading.Lock()


@functools.cache
def in_use() -> Isa | None:
    """The kernels this process uses: None where torch's are asked for or ours cannot load."""
    return loaded() if requested() is Kernels.NATIVE else None


@functools.cache
def loaded() -> Isa | None:
    """Build this CPU's kernels (once per machine) and load them; None if it cannot."""
    with _lock:
        return _load()


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
    return _isa().ops.int4_linear(x.contiguous(), data, scales, bias)


def int8_linear(
    x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, bias=None
) -> torch.Tensor:
    """x [n, in] bf16 times an int8 matrix [out, in] with row scales -> [n, out] bf16."""
    isa = _isa()
    if isa is AMX:
        pairs = x.contiguous().view(torch.int32).T.contiguous()  # [in / 2, n]: the tiles' layout
        return isa.ops.int8_linear(pairs, x.shape[0], data, scales, bias)
    return isa.ops.int8_linear(x.contiguous(), data, scales, bias)


def q6k_linear(x: torch.Tensor, data: torch.Tensor, d: torch.Tensor, bias=None) -> torch.Tensor:
    """x [n, in] bf16 times a q6k matrix (GGUF's Q6_K blocks) -> [n, out] bf16."""
    return _isa().ops.q6k_linear(x.contiguous(), data, d, bias)


def q4k_linear(x: torch.Tensor, records: torch.Tensor, ds: torch.Tensor, bias=None) -> torch.Tensor:
    """x [n, in] bf16 times a q4k matrix (GGUF's Q4_K values in our records) -> [n, out] bf16."""
    return _isa().ops.q4k_linear(x.contiguous(), records, ds, bias)


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
    return _isa().ops.attend(q.contiguous(), keys, values, mask, scale, softcap or 0.0)


def normalizes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether our RMS norm takes these rows [..., d] and weight [d]: both bf16."""
    return x.dtype == weight.dtype == torch.bfloat16 and in_use() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] bf16 -> weight * x / sqrt(mean(x^2) + eps), each row alone (csrc/norm.h)."""
    return _isa().ops.rms_norm(x.contiguous(), weight.contiguous(), eps)


def rotates(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether our rotary embedding takes these heads [H, n, hd] and tables [n, hd]: bf16."""
    return x.dtype == cos.dtype == torch.bfloat16 and x.stride(-1) == 1 and in_use() is not None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [H, n, hd] bf16 (strided in H and n) -> the same rotated, contiguous, rounded as
    model/rope.py's torch code rounds it (csrc/rope.h)."""
    return _isa().ops.rope(x, cos.contiguous(), sin.contiguous())


def decoder_layer(x, norms, matrices, formats, biases, cache, at, place, shape, softcap):
    """One decoder layer in one call (csrc/layer.h; model/fused.py builds the arguments):
    x [n, d] bf16; cache: (keys, values, slot positions); at: (layer, committed length, span);
    shape: (heads, head dim, norm eps, attention scale) -> x after the layer."""
    layer, length, span = at
    heads, head_dim, eps, scale = shape
    return _isa().ops.decoder_layer(
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


def _isa() -> Isa:
    isa = loaded()
    if isa is None:
        raise RuntimeError("our kernels did not load on this machine")
    return isa


def _load() -> Isa | None:
    why: str | None  # None once the kernels load
    isa, why = _supported()
    if isa is not None:
        try:
            torch.ops.load_library(str(_built(isa)))
        except subprocess.CalledProcessError as error:
            why = f"the {isa.name} build failed: {error.stderr.strip().splitlines()[-1:]}"
        except (OSError, RuntimeError) as error:
            why = f"loading the {isa.name} kernels failed: {error}"
        else:
            why = None if isa is not AMX or isa.ops.enable_tiles() else "Linux refused AMX state"
    if why is not None:
        log.warning("torch's kernels in use for quantized weights", reason=why)
        return None
    return isa


def _supported() -> tuple[Isa | None, str]:
    """This CPU's preferred kernels, or None and why there are none."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None, "no /proc/cpuinfo (not Linux)"
    isa = next((isa for isa in ISAS if set(isa.cpu_flags) <= flags), None)
    if isa is None:
        return None, f"this CPU lacks {', '.join(f for f in AVX2.cpu_flags if f not in flags)}"
    if shutil.which("g++") is None:
        return None, "no C++ compiler (g++)"
    return isa, ""


def _built(isa: Isa) -> Path:
    """The kernels' shared library for this source, torch and compiler: built if missing, and
    rebuilt if it is not the file its stamp describes (mapping a truncated library kills the
    process with SIGBUS). One process builds at a time; the others wait and take its library."""
    library = _library_path(isa)
    if _intact(library):
        return library
    with exclusive(library.parent, lambda: log.info("waiting for another process's build")):
        if not _intact(library):  # unless the process we waited for built it
            _rebuild(isa, library)
    return library


def _library_path(isa: Isa) -> Path:
    compiler = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout
    texts = [path.read_text() for path in (isa.source, *isa.headers)]
    stamp = "\n".join((*texts, torch.__version__, compiler, *_flags(isa)))
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    return default_cache_dir() / "kernels" / f"{isa.name}-{key}.so"


def _flags(isa: Isa) -> tuple[str, ...]:
    return ("-O3", "-std=c++20", "-fPIC", *isa.compile_flags)


def _stamp_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _digest(path: Path) -> bytes:
    """A stamp's text: the file's size and sha256."""
    data = path.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}\n".encode()


def _intact(library: Path) -> bool:
    """Whether `library` and its stamp exist and agree."""
    try:
        return _stamp_path(library).read_bytes() == _digest(library)
    except FileNotFoundError:
        return False


def _rebuild(isa: Isa, library: Path) -> None:
    """Build `library` under a temporary name, put it on disk, rename it, then stamp it: a
    crash at any point leaves no stamp that vouches for a partial file."""
    if library.exists():
        why = "not the file their stamp describes"
        log.warning(f"rebuilding the cached kernels: {why}", library=str(library))
    log.info(f"building the {isa.name} kernels (once per machine)", library=str(library))
    partial = library.with_suffix(f".{os.getpid()}.partial")
    try:
        _compile(isa, partial)
        _synced(partial)
        partial.replace(library)  # whole or absent, whoever builds beside us
    finally:
        partial.unlink(missing_ok=True)
    stamp = _stamp_path(library).with_suffix(f".{os.getpid()}.partial")
    stamp.write_bytes(_digest(library))
    _synced(stamp)
    stamp.replace(_stamp_path(library))


def _compile(isa: Isa, out: Path) -> None:
    """Compile and link `isa`'s kernels into the shared library `out`."""
    objects = out.with_suffix(".o")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    home = Path(torch.__file__).parent  # torch's headers and libraries, as a wheel lays them out
    includes, libraries = [f"-I{home / 'include'}"], [f"-L{home / 'lib'}"]
    try:
        # OpenMP at compile time only: the library then uses torch's own OpenMP runtime
        flags = [*_flags(isa), "-fopenmp", abi, *includes]
        _run(["g++", *flags, "-c", str(isa.source), "-o", str(objects)])
        _run(["g++", "-shared", str(objects), "-o", str(out), *libraries, "-lc10", "-ltorch_cpu"])
    finally:
        objects.unlink(missing_ok=True)


def _synced(path: Path) -> None:
    """Flush `path`'s data to disk, so that a rename after it never names a partial file."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)
