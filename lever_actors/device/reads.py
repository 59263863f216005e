"""Reads extents of a flash layout into aligned DRAM buffers, bypassing the page cache,
without torch (device/flash.py's FlashStore views them as torch's weights).

O_DIRECT reads go straight from the device into the buffer. Where the filesystem refuses
O_DIRECT (tmpfs, some overlays) the reader falls back to ordinary reads followed by
POSIX_FADV_DONTNEED, so that the next read of the same bytes still comes from storage.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lever_actors.device.checksums import CHUNK_BYTES, checksum
from lever_actors.device.manifest import (
    ALIGNMENT,
    WEIGHTS_NAME,
    Extent,
    Manifest,
    TensorEntry,
    align_up,
    read_manifest,
)
from lever_actors.errors import CheckpointError, ConfigError, CorruptLayoutError
from lever_actors.logs import get_logger

log = get_logger(__name__)

# Sustained sequential read of phone storage, bytes/s (UFS 3.1 ~1.5 GB/s, UFS 4.0 ~3 GB/s as
# measured for large reads in phones; spec-sheet peaks are higher).
THROTTLE_PROFILES: dict[str, float | None] = {"none": None, "ufs3.1": 1.5e9, "ufs4.0": 3.0e9}


HUGE_PAGE = 2 << 20  # x86's transparent huge page
# resident extents read at once: the real target (1.06 GiB) loaded in 0.58-0.66 s on two
# threads, one at a time 0.66-0.81 s (2-core EPYC, 2026-12-06)
LOADERS = 2


class AlignedBuffer:
    """Page-aligned private anonymous memory (mmap), as a memoryview and a numpy array of its
    bytes (device/flash.py views it as torch tensors). With `huge`,
    huge pages where the kernel allows them, for a buffer reused across reads: an O_DIRECT
    read pins its buffer page by page, and into 4 KiB pages of shared memory the real
    target's layers came at 1.3 GB/s on the Zen 4 VM against 2.6 into huge pages. A buffer
    read once (resident weights) takes 4 KiB pages: the kernel compacts memory for each huge
    page as it first faults in, and the real target's 1.06 GiB then loaded in 2.3-3.0 s
    against 0.9 (2-core EPYC VM, warm page cache), its decode no faster (25.0 and 22.9 tok/s
    against 25.1 and 24.8)."""

    def __init__(self, nbytes: int, *, huge: bool = True) -> None:
        self.nbytes = align_up(max(nbytes, 1))
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge and self.nbytes >= HUGE_PAGE:
            with contextlib.suppress(OSError):  # a kernel without huge pages: 4 KiB ones
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self.view = memoryview(self._map)
        self.array = np.frombuffer(self._map, dtype=np.uint8)


@dataclass
class ReadStats:
    reads: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int, seconds: float) -> None:
        with self.lock:
            self.reads += 1
            self.bytes_read += nbytes
            self.read_seconds += seconds


class LayoutReader:
    """One flash layout opened for reads into aligned buffers, without torch. Thread-safe:
    reads use pread at explicit offsets. With `verify` (the default) every byte read is
    checked against its checksum before it is handed out: a mismatch is a CorruptLayoutError."""

    def __init__(
        self,
        directory: Path,
        *,
        throttle: str = "none",
        verify: bool = True,
        direct: bool = True,
    ) -> None:
        if throttle not in THROTTLE_PROFILES:
            raise ConfigError(
                f"unknown throttle profile {throttle!r}; known: {list(THROTTLE_PROFILES)}"
            )
        self.directory = directory
        self.manifest: Manifest = read_manifest(directory)
        self.path = directory / WEIGHTS_NAME
        self.bandwidth_cap = THROTTLE_PROFILES[throttle]
        self.verify = verify
        self.stats = ReadStats()
        self._check_bounds()
        self.fd, self.direct = open_for_reads(self.path, direct)
        if not self.direct:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # start from a cold cache
            log.warning(
                "flash.buffered_fallback",
                path=str(self.path),
                reason="O_DIRECT refused; using reads + POSIX_FADV_DONTNEED",
            )

    @property
    def mode(self) -> str:
        return read_mode(self.direct)

    def close(self) -> None:
        """Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read_bytes(self, extent: Extent, buffer: AlignedBuffer, *, check: bool = True) -> None:
        """Blocking: one sequential read of the whole extent into `buffer`. With `check=False`
        the caller must `check_extent` before it uses the bytes."""
        if buffer.nbytes < extent.nbytes:
            raise ValueError(
                f"buffer of {buffer.nbytes} bytes cannot hold {extent.key} ({extent.nbytes})"
            )
        self._read_into(buffer, 0, extent.offset, extent.nbytes)
        if check:
            self.check_extent(extent, buffer)

    def load_bytes(self, extent: Extent) -> AlignedBuffer:
        """Blocking: an extent read and checked into its own new buffer, for weights that stay
        resident (4 KiB pages: see AlignedBuffer)."""
        buffer = AlignedBuffer(extent.nbytes, huge=False)
        self.read_bytes(extent, buffer)
        return buffer

    def load_all(self, extents: Sequence[Extent]) -> list[AlignedBuffer]:
        """Blocking: `load_bytes` of each extent, LOADERS at a time (one's page faults and
        checksums beside another's transfer), in their order."""
        with ThreadPoolExecutor(LOADERS, thread_name_prefix="resident-load") as loaders:
            return list(loaders.map(self.load_bytes, extents))

    def check_extent(self, extent: Extent, buffer: AlignedBuffer) -> None:
        """Blocking: every tensor of the extent read into `buffer` against its checksum (when
        this store verifies); a mismatch is a CorruptLayoutError."""
        if self.verify:
            for t in extent.tensors:
                data = buffer.view[t.offset : t.offset + t.nbytes]
                self._check(data, t.checksum, t, extent.offset + t.offset)

    def row_records(self, extent: Extent, rows: list[int]) -> np.ndarray:
        """Rows of a 2-D single-tensor extent (the embedding table) as stored, each by its own
        small read of the aligned span around it (`read_span`) -> [len(rows), row bytes]"""
        (entry,) = extent.tensors
        row_bytes = entry.nbytes // entry.shape[0]
        buffer = AlignedBuffer(self.span_buffer_bytes(row_bytes))
        out = np.empty((len(rows), row_bytes), np.uint8)
        for i, row in enumerate(rows):
            out[i] = self.read_span(extent, entry, row * row_bytes, (row + 1) * row_bytes, buffer)
        return out

    def span_buffer_bytes(self, nbytes: int) -> int:
        """A buffer that holds any span of `nbytes` of a tensor as `read_span` reads it:
        widened to whole checksum chunks when verifying, and to alignment either side."""
        unit = CHUNK_BYTES if self.verify else ALIGNMENT
        return align_up(nbytes) + 2 * unit + 2 * ALIGNMENT

    def read_span(
        self, extent: Extent, entry: TensorEntry, lo: int, hi: int, buffer: AlignedBuffer
    ) -> np.ndarray:
        """Blocking: bytes lo:hi of a tensor stored with chunk checksums (a table read by
        rows), by one read widened to whole checksum chunks when verifying, each checked.
        -> [hi - lo] uint8, a view into `buffer`"""
        if not self.verify:
            return self._read_exact(extent, entry, lo, hi, buffer)
        first = lo - lo % CHUNK_BYTES
        end = min(-(-hi // CHUNK_BYTES) * CHUNK_BYTES, entry.nbytes)
        chunks = self._read_exact(extent, entry, first, end, buffer)
        tensor_start = extent.offset + entry.offset
        for at in range(first, end, CHUNK_BYTES):
            chunk = chunks[at - first : min(at + CHUNK_BYTES, entry.nbytes) - first]
            expected = entry.chunk_checksums[at // CHUNK_BYTES]
            self._check(chunk.data, expected, entry, tensor_start + at)
        return chunks[lo - first : hi - first]

    def _read_exact(
        self,
        extent: Extent,
        entry: TensorEntry,
        lo: int,
        hi: int,
        buffer: AlignedBuffer,
        at: int = 0,
    ) -> np.ndarray:
        """Bytes lo:hi of a tensor of `extent` by one read of the aligned span around them,
        into `buffer` from its aligned byte `at`. -> [hi - lo] uint8, a view into `buffer`"""
        tensor_start = extent.offset + entry.offset
        read_from = tensor_start + lo
        read_from -= read_from % ALIGNMENT
        self._read_into(buffer, at, read_from, align_up(tensor_start + hi) - read_from)
        skip = at + tensor_start - read_from  # tensor byte b sits at buffer index skip + b
        return buffer.array[skip + lo : skip + hi]

    def _read_into(self, buffer: AlignedBuffer, at: int, offset: int, nbytes: int) -> None:
        started = time.perf_counter()
        pread_exact(self.fd, buffer.view[at : at + nbytes], offset, self.path)
        if not self.direct:
            os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        if self.bandwidth_cap:
            # emulate slower storage: never finish faster than the profile allows
            floor = nbytes / self.bandwidth_cap
            elapsed = time.perf_counter() - started
            if elapsed < floor:
                time.sleep(floor - elapsed)
        self.stats.add(nbytes, time.perf_counter() - started)

    def _check(self, data: memoryview, expected: int, entry: TensorEntry, offset: int) -> None:
        if checksum(data) != expected:
            raise CorruptLayoutError(
                f"{self.path}: checksum mismatch in tensor {entry.name!r}, {len(data)} bytes "
                f"at byte {offset} (the file is corrupt; convert again)"
            )

    def _check_bounds(self) -> None:
        if not self.path.is_file():
            raise CheckpointError(f"{self.directory}: {WEIGHTS_NAME} is missing")
        size = self.path.stat().st_size
        for extent in self.manifest.extents:
            spans = [
                (f"tensor {t.name!r} of {extent.key}", extent.offset + t.offset + t.nbytes)
                for t in extent.tensors
            ]
            for what, end in [*spans, (f"extent {extent.key}", extent.offset + extent.nbytes)]:
                if end > size:
                    raise CheckpointError(
                        f"{self.path}: {what} ends at byte {end}, past the end of the file "
                        f"({size} bytes): truncated or wrong manifest"
                    )


def read_mode(direct: bool) -> str:
    return "o_direct" if direct else "buffered+fadvise_dontneed"


def pread_exact(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill `view` from `offset`; a short file is a CheckpointError naming it."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointError(
                f"{path}: unexpected end of file at byte {offset + done} "
                f"(wanted {len(view)} bytes from {offset})"
            )
        done += n


def open_for_reads(path: Path, direct: bool = True) -> tuple[int, bool]:
    """Open for O_DIRECT reads when possible; probe with one aligned read since some
    filesystems accept the flag at open and refuse it at read time."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        else:
            probe = mmap.mmap(-1, ALIGNMENT)
            try:
                os.preadv(fd, [memoryview(probe)], 0)
                return fd, True
            except OSError as e:
                os.close(fd)
                if e.errno != errno.EINVAL:
                    raise
            finally:
                probe.close()
    return os.open(path, os.O_RDONLY), False
