"""This process's own memory figures."""

from __future__ import annotations

import resource
from pathlib import Path


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
