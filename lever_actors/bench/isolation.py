"""Memory limits for benchmark children: one cgroup per mode, with a memory limit the kernel
enforces (page cache included), and the peak figures to report.

Works with a cgroup v2 memory controller (memory.max / memory.peak) or, where the machine
only offers the v1 hierarchy, the v1 memory controller (memory.limit_in_bytes /
memory.max_usage_in_bytes). Needs root and a writable cgroup of our own; without them the
benchmark still runs children and measures peak RSS, and says the limit was not enforced.

Beside the cgroups: the bytes a process has read from storage, and eviction
of weight files from the page cache, so that the next read of them comes from storage.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CgroupSupport:
    version: int | None  # 1 or 2 where a memory limit can be set, else None
    base: Path | None  # our own cgroup in that hierarchy: children are made under it
    reason: str  # why not, or where

    @property
    def usable(self) -> bool:
        return self.version is not None

    def describe(self) -> str:
        if not self.usable:
            return f"no memory limits: {self.reason}"
        return f"memory limits by the cgroup v{self.version} memory controller"


def probe_cgroup(proc: Path = Path("/proc/self")) -> CgroupSupport:
    """Which memory controller this process may put children under; changes nothing."""
    if os.geteuid() != 0:
        return CgroupSupport(None, None, "not root")
    try:
        memberships = _memberships(proc / "cgroup")
        mounts = _cgroup_mounts(proc / "mountinfo")
    except OSError as e:
        return CgroupSupport(None, None, f"cannot read cgroup memberships ({e.strerror})")
    reasons = []
    v2 = _probe_v2(memberships, mounts)
    if v2.usable:
        return v2
    reasons.append(v2.reason)
    v1 = _probe_v1(memberships, mounts)
    if v1.usable:
        return v1
    reasons.append(v1.reason)
    return CgroupSupport(None, None, "; ".join(reasons))


def _memberships(path: Path) -> dict[str, str]:
    """controller list ("" for v2, "memory", "cpu,cpuacct", ...) -> cgroup path."""
    out = {}
    for line in path.read_text().splitlines():
        _, controllers, cgroup = line.split(":", 2)
        out[controllers] = cgroup
    return out


def _cgroup_mounts(path: Path) -> list[tuple[str, Path, str, set[str]]]:
    """(fs type, mount point, root inside the hierarchy, super options) of cgroup mounts."""
    mounts = []
    for line in path.read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 3 or rest[0] not in ("cgroup", "cgroup2"):
            continue
        mounts.append((rest[0], Path(fields[4]), fields[3], set(rest[2].split(","))))
    return mounts


def _inside(mount: Path, root: str, cgroup: str) -> Path | None:
    """The directory of `cgroup` under a mount whose root is `root`, if the mount shows it."""
    relative = os.path.relpath(cgroup, root)
    if relative.startswith(".."):
        return None
    return (mount / relative).resolve() if relative != "." else mount


def _probe_v2(memberships: dict[str, str], mounts) -> CgroupSupport:
    if "" not in memberships:
        return CgroupSupport(None, None, "v2: this process is in no v2 cgroup")
    for fstype, mount, root, _ in mounts:
        if fstype != "cgroup2":
            continue
        base = _inside(mount, root, memberships[""])
        if base is None or not (base / "cgroup.controllers").is_file():
            continue
        controllers = (base / "cgroup.controllers").read_text().split()
        if "memory" not in controllers:
            return CgroupSupport(None, None, f"v2 at {mount}: no memory controller ({controllers})")
        if not os.access(base, os.W_OK):
            return CgroupSupport(None, None, f"v2: {base} is not writable")
        enabled = (base / "cgroup.subtree_control").read_text().split()
        busy = (base / "cgroup.procs").read_text().split()
        if "memory" not in enabled and busy and base != mount:
            # the no-internal-processes rule: a populated cgroup cannot delegate memory
            return CgroupSupport(
                None, None, f"v2: memory is not delegated below {base}, which holds processes"
            )
        return CgroupSupport(2, base, "")
    return CgroupSupport(None, None, "v2: no cgroup2 mount shows our cgroup")


def _probe_v1(memberships: dict[str, str], mounts) -> CgroupSupport:
    cgroup = next((p for c, p in memberships.items() if "memory" in c.split(",")), None)
    if cgroup is None:
        return CgroupSupport(None, None, "v1: no memory controller in /proc/self/cgroup")
    for fstype, mount, root, options in mounts:
        if fstype != "cgroup" or "memory" not in options:
            continue
        base = _inside(mount, root, cgroup)
        if base is None or not (base / "memory.limit_in_bytes").is_file():
            continue
        if not os.access(base, os.W_OK):
            return CgroupSupport(None, None, f"v1: {base} is not writable")
        return CgroupSupport(1, base, "")
    return CgroupSupport(None, None, "v1: no memory hierarchy mount shows our cgroup")


class MemoryCgroup:
    """One child cgroup with a memory limit; remove() it once its processes have exited."""

    def __init__(self, support: CgroupSupport, name: str, limit_bytes: int) -> None:
        if not support.usable or support.base is None:
            raise OSError(f"memory cgroups are not usable here: {support.reason}")
        self.version = support.version
        self.path = support.base / name
        if self.version == 2:
            _enable_v2_memory(support.base)
        self.path.mkdir(exist_ok=True)
        try:
            if self.version == 2:
                _write(self.path / "memory.max", str(limit_bytes))
                if (self.path / "memory.swap.max").exists():
                    _write(self.path / "memory.swap.max", "0")
            else:
                _write(self.path / "memory.limit_in_bytes", str(limit_bytes))
            self.limit_bytes = self._read_limit()
        except BaseException:
            self.remove()
            raise

    def add(self, pid: int) -> None:
        _write(self.path / "cgroup.procs", str(pid))

    def peak_bytes(self) -> int | None:
        """Highest memory use so far (page cache included); None where the kernel lacks it."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def oom_kills(self) -> int:
        """How many processes the limit has killed."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            pass  # still populated by a child that did not exit: the kernel keeps it

    def _read_limit(self) -> int:
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        return int((self.path / name).read_text().split()[0])


def _enable_v2_memory(base: Path) -> None:
    control = base / "cgroup.subtree_control"
    if "memory" not in control.read_text().split():
        _write(control, "+memory")


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def storage_read_bytes() -> int | None:
    """Bytes this process has had read from storage (page cache misses), from /proc/self/io."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def evict_from_page_cache(paths: list[Path]) -> int:
    """Drop every regular file under `paths` from DRAM, so that the next read of it comes
    from storage; returns the bytes of the files. See evict_ranges."""
    files = []
    for path in paths:
        files += [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return evict_ranges({file: None for file in files})


def evict_ranges(ranges: dict[Path, list[tuple[int, int]] | None]) -> int:
    """Drop byte ranges of files (None: the whole file) from DRAM; returns the bytes covered.

    POSIX_FADV_DONTNEED drops cached pages that no process maps. Pages this process maps
    (safetensors and numpy memory-map their files) stay resident through it, so ranges
    mapped here are also paged out with madvise(MADV_PAGEOUT) (Linux >= 5.4); clean file
    pages are then simply dropped. Pages other processes map cannot be reached."""
    maps = _own_file_mappings()
    total = 0
    for file, spans in ranges.items():
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            spans = [(0, size)] if spans is None else spans
            for start, end in spans:
                _pageout(maps.get(os.path.realpath(file), []), start, end)
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
                total += end - start
        finally:
            os.close(fd)
    return total


_MADV_PAGEOUT = 21
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _own_file_mappings() -> dict[str, list[tuple[int, int, int]]]:
    """path -> [(start address, end address, file offset)] of this process's mappings."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        out.setdefault(fields[5], []).append((start, end, int(fields[2], 16)))
    return out


def _pageout(mappings: list[tuple[int, int, int]], start: int, end: int) -> None:
    """madvise(MADV_PAGEOUT) the part of file bytes [start, end) that these mappings show."""
    if not mappings:
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for map_start, map_end, offset in mappings:
        lo = max(start, offset) - offset + map_start
        hi = min(end, offset + (map_end - map_start)) - offset + map_start
        lo -= lo % _PAGE
        if hi > lo:
            libc.madvise(lo, hi - lo, _MADV_PAGEOUT)  # best effort: EINVAL on old kernels
