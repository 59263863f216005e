"""Raw sequential read bandwidth of the disk under a file, with reads like the prefetcher's."""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec

from lever_actors.device.manifest import ALIGNMENT
from lever_actors.device.reads import AlignedBuffer, open_for_reads, pread_exact, read_mode
from lever_actors.errors import ConfigError


class DiskProfile(msgspec.Struct, frozen=True):
    path: str
    mode: str  # "o_direct" or "buffered+fadvise_dontneed"
    block_bytes: int
    bytes_read: int
    seconds: float

    @property
    def bandwidth(self) -> float:
        """bytes per second"""
        return self.bytes_read / self.seconds


def profile_disk(path: Path, block_bytes: int, max_bytes: int | None = None) -> DiskProfile:
    """Read `path` front to back in `block_bytes` blocks (up to `max_bytes`), one block at a
    time, bypassing the page cache, and time it. Blocks are whole multiples of ALIGNMENT."""
    if block_bytes < ALIGNMENT:
        raise ConfigError(f"block size {block_bytes} B: at least {ALIGNMENT} B")
    if max_bytes is not None and max_bytes < ALIGNMENT:
        raise ConfigError(f"max bytes {max_bytes} B: at least {ALIGNMENT} B")
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    block_bytes -= block_bytes % ALIGNMENT
    size = path.stat().st_size
    limit = min(size, max_bytes or size)
    limit -= limit % ALIGNMENT
    fd, direct = open_for_reads(path)
    buffer = AlignedBuffer(block_bytes)
    done = 0
    if not direct:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # start from a cold cache
    try:
        started = time.perf_counter()
        while done < limit:
            n = min(block_bytes, limit - done)
            pread_exact(fd, buffer.view[:n], done, path)
            if not direct:
                os.posix_fadvise(fd, done, n, os.POSIX_FADV_DONTNEED)
            done += n
        seconds = time.perf_counter() - started
    finally:
        os.close(fd)
    return DiskProfile(str(path), read_mode(direct), block_bytes, done, seconds)
