"""This process's own memory figures."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
from pathlib import Path

_LIBC_NAME = ctypes.util.find_library("c")
_libc = ctypes.CDLL(_LIBC_NAME) if _LIBC_NAME else None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: VmHWM, the high-water mark of its own memory.
    Not getrusage's ru_maxrss, which a child inherits from the parent it was forked from."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def return_freed_heap() -> None:
    """Give the C heap's free pages back to the kernel (glibc's malloc_trim; elsewhere
    nothing). Loading a model frees many large temporaries that glibc would keep mapped:
    about 400 MB after the real draft's GGUF, which a memory limit would count."""
    if _libc is not None and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)
