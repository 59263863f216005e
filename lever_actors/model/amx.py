"""The AMX kernels of csrc/amx.cpp: built once per machine with the system's C++ compiler
into the cache, loaded as torch ops, used for every int4 and int8 matrix they fit.

torch's weight-only kernels cost about as much per row as one-token decoding, so a tree of
64 nodes costs nearly 64 passes. The tile kernels unpack each weight once per call and
multiply every row on AMX: 64 rows cost 4-6x one row per matrix, a target pass about 3x
(docs/design.md, "Kernels").
They are the default where they load; `LEVER_ACTORS_KERNELS=torch` keeps torch's kernels
(one row costs them less, int8's most: memory-resident AR decoded about 15% faster on
torch's, measured before the prefetch).
Where a CPU has no AMX, no compiler is found or the build fails, torch's kernels stay in use,
and the reason is logged once.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import threading
from enum import Enum
from pathlib import Path

import torch

from lever_actors.logs import get_logger
from lever_actors.paths import default_cache_dir

log = get_logger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "amx.cpp"
BLOCK_N = 64  # outputs per block of the kernels
DEPTH = 32  # inputs per tile product
# below this many rows torch's kernels are faster (int8 most: 1 row 0.6 against 1.0-2.1 ms
# for the real target's largest matrices); only a matrix whose rows need not round as alone
# (a draft's) may switch kernel by rows
FEWEST_ROWS = 8
CPU_FLAGS = ("amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")
ISA = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma")
COMPILE = ("-O3", "-std=c++20", "-fPIC", *ISA, "-mamx-tile", "-mamx-bf16")


class Kernels(Enum):
    AMX = "amx"  # the tile kernels where this machine has AMX (the default)
    TORCH = "torch"  # torch's weight-only kernels everywhere


_lock = threading.Lock()


@functools.cache
def available() -> bool:
    """Whether the AMX kernels are in use in this process: not declined, and loaded."""
    return requested() is Kernels.AMX and load()


@functools.cache
def load() -> bool:
    """Build the kernels (once per machine) and load them; whether this process can use them."""
    with _lock:
        return _load()


def fits(fmt: str, shape: tuple[int, int]) -> bool:
    """Whether a matrix of this format and [out, in] shape runs on the AMX kernels."""
    out, inputs = shape
    return fmt in ("int4", "int8") and out % BLOCK_N == 0 and inputs % DEPTH == 0 and available()


def int4_linear(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [n, in] bf16 times an int4 matrix in torch's CPU packing -> [n, out] bf16."""
    return torch.ops.lever_amx.int4_linear(x.contiguous(), data, scales)


def int8_linear(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [n, in] bf16 times an int8 matrix [out, in] with row scales -> [n, out] bf16."""
    pairs = x.contiguous().view(torch.int32).T.contiguous()  # [in / 2, n]: the tiles' layout
    return torch.ops.lever_amx.int8_linear(pairs, x.shape[0], data, scales)


def requested() -> Kernels:
    value = os.environ.get("LEVER_ACTORS_KERNELS", Kernels.AMX.value)
    try:
        return Kernels(value)
    except ValueError:
        choices = ", ".join(k.value for k in Kernels)
        log.warning("unknown LEVER_ACTORS_KERNELS; using amx", value=value, choices=choices)
        return Kernels.AMX


def _load() -> bool:
    why = _unsupported()
    if why is None:
        try:
            torch.ops.load_library(str(_built()))
        except subprocess.CalledProcessError as error:
            why = f"the build failed: {error.stderr.strip().splitlines()[-1:]}"
        except (OSError, RuntimeError) as error:
            why = f"loading failed: {error}"
        else:
            why = None if torch.ops.lever_amx.enable_tiles() else "Linux refused AMX state"
    if why is not None:
        log.warning("torch's kernels in use for quantized weights", reason=why)
    return why is None


def _unsupported() -> str | None:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "no /proc/cpuinfo (not Linux)"
    missing = [flag for flag in CPU_FLAGS if flag not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if shutil.which("g++") is None:
        return "no C++ compiler (g++)"
    return None


def _built() -> Path:
    """The kernels' shared library for this source, torch and compiler (built if missing)."""
    compiler = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\n".join((SOURCE.read_text(), torch.__version__, compiler, *COMPILE)).encode()
    ).hexdigest()[:16]
    library = default_cache_dir() / "kernels" / f"amx-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the AMX kernels (once per machine)", library=str(library))
    partial = library.with_suffix(f".{os.getpid()}.partial")
    objects = partial.with_suffix(".o")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    home = Path(torch.__file__).parent  # torch's headers and libraries, as a wheel lays them out
    includes, libraries = [f"-I{home / 'include'}"], [f"-L{home / 'lib'}"]
    try:
        # OpenMP at compile time only: the library then uses torch's own OpenMP runtime
        _run(["g++", *COMPILE, "-fopenmp", abi, *includes, "-c", str(SOURCE), "-o", str(objects)])
        link = [*libraries, "-lc10", "-ltorch_cpu"]
        _run(["g++", "-shared", str(objects), "-o", str(partial), *link])
        partial.replace(library)  # whole or absent, whoever builds beside us
    finally:
        objects.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return library


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)
