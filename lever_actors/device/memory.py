"""This process's own memory figures."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
from pathlib import Path

_LIBC_NAME = ctypes.util.find_library("c")
_libc = ctypes.CDLL(_LIBC_NAME) if _LIBC_NAME else None
# glibc's mallopt parameters: the smallest block given its own mapping, and the free bytes
# at the top of a heap above which it shrinks
M_MMAP_THRESHOLD = -3
M_TRIM_THRESHOLD = -1
OWN_MAPPING_BYTES = 4 << 20


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


def map_large_blocks(threshold: int = OWN_MAPPING_BYTES) -> None:
    """From now on give each C-heap block of `threshold` bytes or more a mapping of its own,
    unmapped when freed (glibc's mallopt; elsewhere nothing). glibc otherwise raises that
    threshold to the largest block freed so far, up to 32 MiB, and the heap's trim threshold
    to twice that, and then keeps a step's temporaries in each thread's heap until the next
    trim: at 1 GiB, gain-cost steps peaked 100 MB higher. Both thresholds are set back.
    Each large block costs its page faults instead, about 0.2 ms per MB, so only a process
    short of memory should ask for this."""
    if _libc is not None and hasattr(_libc, "mallopt"):
        _libc.mallopt(M_MMAP_THRESHOLD, threshold)
        _libc.mallopt(M_TRIM_THRESHOLD, threshold)
