"""This process's own memory figures, and the memory it may use."""

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
    peak = _status_field("VmHWM:")
    return peak or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


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


def anonymous_rss_bytes() -> int:
    """This process's resident memory now that the kernel cannot reclaim under a limit
    (RssAnon: its heap, the weights it read; not the file pages of its libraries)."""
    return _status_field("RssAnon:")


def file_rss_bytes() -> int:
    """This process's resident file pages (RssFile): its libraries' code and data, which a
    limit can reclaim but must then page in again."""
    return _status_field("RssFile:")


def memory_limit_bytes(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int:
    """What this process may hold in all: the tightest memory limit of its cgroups (v2
    memory.max, v1 memory.limit_in_bytes, each up to the hierarchy's root), and at most
    what the machine has free beside what we hold (MemAvailable + our anonymous RSS)."""
    return min([_free_bytes(proc), *(limit for limit, _, _ in _cgroup_limits(proc, cgroups))])


def charged_file_bytes(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int:
    """The file pages this process maps that its memory limit counts: RssFile, or fewer where
    the cgroup whose limit binds has fewer mapped pages charged to it. A page stays charged to
    the cgroup that read it first, so libraries another process loaded cost this limit
    nothing (under a bench's fresh cgroup, 5 of torch's 81 MiB)."""
    mapped = file_rss_bytes()
    binding = min(_cgroup_limits(proc, cgroups), default=None, key=lambda found: found[0])
    if binding is None or binding[0] >= _free_bytes(proc):
        return mapped
    _, directory, key = binding
    charged = _stat_field(directory / "memory.stat", key)
    return mapped if charged is None else min(mapped, charged)


def _free_bytes(proc: Path) -> int:
    """What the machine has free beside what we hold: MemAvailable + our anonymous RSS."""
    return _available_bytes(proc) + anonymous_rss_bytes()


def _cgroup_limits(proc: Path, cgroups: Path) -> list[tuple[int, Path, str]]:
    """Each memory limit set on this process's cgroups and those above them: (the limit, its
    cgroup's directory, the memory.stat key of the mapped file pages charged there)."""
    try:
        memberships = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        memberships = []
    limits = []
    for line in memberships:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            limits += _limits_up(cgroups / "unified", path, "memory.max", "file_mapped")
            limits += _limits_up(cgroups, path, "memory.max", "file_mapped")
        elif "memory" in controllers.split(","):
            limits += _limits_up(
                cgroups / "memory", path, "memory.limit_in_bytes", "total_mapped_file"
            )
    return limits


def _limits_up(root: Path, path: str, name: str, mapped_key: str) -> list[tuple[int, Path, str]]:
    """The limits `name` sets on cgroup `path` and each cgroup above it under `root`."""
    found = []
    directory = root / path.lstrip("/")
    while True:
        try:
            text = (directory / name).read_text().strip()
        except OSError:
            text = "max"
        if text != "max":
            found.append((int(text), directory, mapped_key))
        if directory == root or root not in directory.parents:
            return found
        directory = directory.parent


def _available_bytes(proc: Path) -> int:
    available = _kib_field(proc / "meminfo", "MemAvailable:")
    return (1 << 62) if available is None else available  # not known: no bound from it


def _status_field(name: str) -> int:
    return _kib_field(Path("/proc/self/status"), name) or 0


def _stat_field(path: Path, key: str) -> int | None:
    """The value of the "KEY N" line of a cgroup's memory.stat; None where it has none."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def _kib_field(path: Path, name: str) -> int | None:
    """The bytes of the "NAME: N kB" line of a /proc file; None where it has none."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(name):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
