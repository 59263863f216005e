"""Building our kernels, with or without torch: which instruction set this CPU has, g++'s
flags for it, and the cache of built libraries (keyed by the source, every header beside it,
the compiler, the flags and what the caller adds; one build at a time per machine; each file
stamped with its size and hash and rebuilt where it does not match). model/native_build.py
builds them as torch ops, model/plain.py as a plain C library; this module imports no torch.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lever_actors.logs import get_logger
from lever_actors.paths import default_cache_dir, exclusive

log = get_logger(__name__)

CSRC = Path(__file__).parent / "csrc"


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
        return CSRC / f"{self.stem}.cpp"


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


def supported(isas: tuple[Isa, ...] = ISAS) -> tuple[Isa | None, str]:
    """The first of `isas` this CPU runs, or None and why there is none."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None, "no /proc/cpuinfo (not Linux)"
    isa = next((isa for isa in isas if set(isa.cpu_flags) <= flags), None)
    if isa is None:
        return None, f"this CPU lacks {', '.join(f for f in AVX2.cpu_flags if f not in flags)}"
    if shutil.which("g++") is None:
        return None, "no C++ compiler (g++)"
    return isa, ""


def flags(isa: Isa) -> tuple[str, ...]:
    return ("-O3", "-std=c++20", "-fPIC", *isa.compile_flags)


def library_path(name: str, source: Path, extra: tuple[str, ...]) -> Path:
    """The cached library `name`-<key>.so of `source`, its headers, the compiler and `extra`
    (the flags, and what else changes the build)."""
    compiler = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout
    texts = [path.read_text() for path in (source, *sorted(source.parent.glob("*.h")))]
    stamp = "\n".join((*texts, compiler, *extra))
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    return default_cache_dir() / "kernels" / f"{name}-{key}.so"


def built(library: Path, compile: Callable[[Path], None], what: str) -> Path:
    """`library`, built by `compile` if missing, and rebuilt if it is not the file its stamp
    describes (mapping a truncated library kills the process with SIGBUS). One process builds
    at a time; the others wait and take its library."""
    if _intact(library):
        return library
    with exclusive(library.parent, lambda: log.info("waiting for another process's build")):
        if not _intact(library):  # unless the process we waited for built it
            rebuild(library, compile, what)
    return library


def rebuild(library: Path, compile: Callable[[Path], None], what: str) -> None:
    """Build `library` under a temporary name, put it on disk, rename it, then stamp it: a
    crash at any point leaves no stamp that vouches for a partial file."""
    if library.exists():
        why = "not the file their stamp describes"
        log.warning(f"rebuilding the cached kernels: {why}", library=str(library))
    log.info(f"building the {what} kernels (once per machine)", library=str(library))
    partial = library.with_suffix(f".{os.getpid()}.partial")
    try:
        compile(partial)
        _synced(partial)
        partial.replace(library)  # whole or absent, whoever builds beside us
    finally:
        partial.unlink(missing_ok=True)
    stamp = _stamp_path(library).with_suffix(f".{os.getpid()}.partial")
    stamp.write_bytes(_digest(library))
    _synced(stamp)
    stamp.replace(_stamp_path(library))


def run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def build_failure(isa: Isa, error: subprocess.CalledProcessError) -> str:
    """Why a build failed, in one line: the compiler's last."""
    return f"the {isa.name} build failed: {error.stderr.strip().splitlines()[-1:]}"


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


def _synced(path: Path) -> None:
    """Flush `path`'s data to disk, so that a rename after it never names a partial file."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
