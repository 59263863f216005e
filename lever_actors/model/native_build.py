"""Building and loading our kernels (model/native.py calls them): which instruction set this
CPU has, g++'s flags for it, the cache key (the source, every header beside it, torch, the
compiler and the flags), one build at a time per machine, and the library loaded as torch ops.
Built once per machine with the system's C++ compiler into the cache, stamped with the
library's size and hash, and rebuilt where the file does not match. Where a CPU has neither
instruction set, no compiler is found or the build fails, nothing loads, and the reason is
logged once.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from lever_actors.logs import get_logger
from lever_actors.paths import default_cache_dir, exclusive

log = get_logger(__name__)


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


_lock = threading.Lock()


@functools.cache
def loaded() -> Isa | None:
    """Build this CPU's kernels (once per machine) and load them; None if it cannot."""
    with _lock:
        return _load()


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
