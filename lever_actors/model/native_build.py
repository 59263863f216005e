"""Loading our kernels as torch ops (model/native.py calls them): this CPU's instruction set
and the cached library, built once per machine with the system's C++ compiler against torch's
headers (model/kernel_build.py). Where a CPU has neither instruction set, no compiler is found
or the build fails, nothing loads, and the reason is logged once.
"""

from __future__ import annotations

import functools
import subprocess
import threading
from pathlib import Path

import torch

from lever_actors.logs import get_logger
from lever_actors.model import kernel_build
from lever_actors.model.kernel_build import AMX, AVX2, AVX512_VNNI, ISAS, Isa

__all__ = ["AMX", "AVX2", "AVX512_VNNI", "ISAS", "Isa", "loaded", "ops"]

log = get_logger(__name__)

_lock = threading.Lock()


@functools.cache
def loaded() -> Isa | None:
    """Build this CPU's kernels (once per machine) and load them; None if it cannot."""
    with _lock:
        return _load()


def ops(isa: Isa):
    """`isa`'s kernels as torch ops, once loaded."""
    return getattr(torch.ops, f"lever_{isa.stem}")


def _load() -> Isa | None:
    why: str | None  # None once the kernels load
    isa, why = _supported()
    if isa is not None:
        try:
            torch.ops.load_library(str(_built(isa)))
        except subprocess.CalledProcessError as error:
            why = kernel_build.build_failure(isa, error)
        except (OSError, RuntimeError) as error:
            why = f"loading the {isa.name} kernels failed: {error}"
        else:
            why = None if isa is not AMX or ops(isa).enable_tiles() else "Linux refused AMX state"
    if why is not None:
        log.warning("torch's kernels in use for quantized weights", reason=why)
        return None
    return isa


def _supported() -> tuple[Isa | None, str]:
    return kernel_build.supported()


def _built(isa: Isa) -> Path:
    return kernel_build.built(_library_path(isa), functools.partial(_compile, isa), isa.name)


def _library_path(isa: Isa) -> Path:
    return kernel_build.library_path(isa.name, isa.source, (torch.__version__, *_flags(isa)))


def _flags(isa: Isa) -> tuple[str, ...]:
    return (*kernel_build.flags(isa), "-DLEVER_ATEN")  # parallel.h: torch's thread pool


def _compile(isa: Isa, out: Path) -> None:
    """Compile and link `isa`'s kernels into the shared library `out`."""
    objects = out.with_suffix(".o")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    home = Path(torch.__file__).parent  # torch's headers and libraries, as a wheel lays them out
    includes, libraries = [f"-I{home / 'include'}"], [f"-L{home / 'lib'}"]
    try:
        # OpenMP at compile time only: the library then uses torch's own OpenMP runtime
        flags = [*_flags(isa), "-fopenmp", abi, *includes]
        kernel_build.run(["g++", *flags, "-c", str(isa.source), "-o", str(objects)])
        kernel_build.run(
            ["g++", "-shared", str(objects), "-o", str(out), *libraries, "-lc10", "-ltorch_cpu"]
        )
    finally:
        objects.unlink(missing_ok=True)
