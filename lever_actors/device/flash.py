"""Reads extents of a flash layout into aligned DRAM buffers, bypassing the page cache.

O_DIRECT reads go straight from the device into the buffer. Where the filesystem refuses
O_DIRECT (tmpfs, some overlays) the store falls back to ordinary reads followed by
POSIX_FADV_DONTNEED, so that the next read of the same bytes still comes from storage.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lever_actors.device.checksums import CHUNK_BYTES, checksum, running_checksum
from lever_actors.device.layout import DTYPE_NAMES, weight_of
from lever_actors.device.manifest import (
    ALIGNMENT,
    ROW_STREAMED_FORMATS,
    WEIGHTS_NAME,
    Extent,
    Manifest,
    TensorEntry,
    align_up,
    read_manifest,
    stored_row_bytes,
)
from lever_actors.errors import CheckpointError, ConfigError, CorruptLayoutError
from lever_actors.logs import get_logger
from lever_actors.model.quantized import QuantizedWeight, decode_rows
from lever_actors.model.weights import Weight

log = get_logger(__name__)

# Sustained sequential read of phone storage, bytes/s (UFS 3.1 ~1.5 GB/s, UFS 4.0 ~3 GB/s as
# measured for large reads in phones; spec-sheet peaks are higher).
THROTTLE_PROFILES: dict[str, float | None] = {"none": None, "ufs3.1": 1.5e9, "ufs4.0": 3.0e9}


HUGE_PAGE = 2 << 20  # x86's transparent huge page


class AlignedBuffer:
    """Page-aligned private anonymous memory (mmap), viewed as torch tensors. With `huge`,
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
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def tensor(self, entry: TensorEntry, base: int = 0) -> Weight:
        """A zero-copy view of one tensor stored at `base + entry.offset` in this buffer."""
        start = base + entry.offset
        return weight_of(entry, self.bytes[start : start + entry.nbytes])


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


class FlashStore:
    """One flash layout opened for reading. Thread-safe: reads use pread at explicit offsets.
    With `verify` (the default) every byte read is checked against its checksum before any
    tensor is handed out: a mismatch is a CorruptLayoutError."""

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
        # reads the next part of a streamed tensor while the caller uses this one
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flash-stream")
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
        self._reader.shutdown()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read_extent(
        self, extent: Extent, buffer: AlignedBuffer, *, check: bool = True
    ) -> dict[str, Weight]:
        """Blocking: one sequential read of the whole extent; tensors are views into `buffer`.
        With `check=False` the caller must `check_extent` before it uses them."""
        if buffer.nbytes < extent.nbytes:
            raise ValueError(
                f"buffer of {buffer.nbytes} bytes cannot hold {extent.key} ({extent.nbytes})"
            )
        self._read_into(buffer, 0, extent.offset, extent.nbytes)
        if check:
            self.check_extent(extent, buffer)
        return {t.name: buffer.tensor(t) for t in extent.tensors}

    def check_extent(self, extent: Extent, buffer: AlignedBuffer) -> None:
        """Blocking: every tensor of the extent read into `buffer` against its checksum (when
        this store verifies); a mismatch is a CorruptLayoutError."""
        if self.verify:
            for t in extent.tensors:
                data = buffer.view[t.offset : t.offset + t.nbytes]
                self._check(data, t.checksum, t, extent.offset + t.offset)

    def load_extent(self, extent: Extent) -> dict[str, Weight]:
        """Read an extent into its own new buffer, for weights that stay resident."""
        return self.read_extent(extent, AlignedBuffer(extent.nbytes, huge=False))

    def read_rows(self, extent: Extent, rows: list[int]) -> torch.Tensor:
        """Rows of a 2-D single-tensor extent (the embedding table), each by its own small read
        of the aligned span around it; verified reads widen the span to whole checksum chunks.
        -> [len(rows), row_width] in the table's dtype (a quantized table's rows decoded)"""
        (entry,) = extent.tensors
        row_bytes = entry.nbytes // entry.shape[0]
        buffer = AlignedBuffer(self.span_buffer_bytes(row_bytes))
        records = torch.stack(
            [
                self.read_span(
                    extent, entry, row * row_bytes, (row + 1) * row_bytes, buffer
                ).clone()
                for row in rows
            ]
        )  # [len(rows), row_bytes] uint8
        if entry.format == "int4rows":
            return decode_rows(records, entry.shape[1])
        return records.view(DTYPE_NAMES[entry.dtype]).view(len(rows), entry.shape[1])

    def stream_rows(
        self, extent: Extent, rows_per_read: int, buffer: AlignedBuffer
    ) -> Iterator[Weight]:
        """Blocking: a 2-D single-tensor extent (the LM head), dense, int8 or q6k, read
        `rows_per_read` rows at a time into the halves of `buffer` (of
        layout.stream_buffer_bytes) in turn: while the caller uses one part, the next is read
        and hashed on the store's reader thread. Each part is a view, valid until the caller
        asks for the next. With verification the tensor is checked after the last part,
        before the caller's loop ends, so nothing made from a corrupt part is handed out.
        -> [rows, in] per part"""
        (entry,) = extent.tensors
        out, inputs = entry.shape
        if entry.format not in ROW_STREAMED_FORMATS:
            raise ValueError(f"a {entry.format} tensor cannot be read by rows")
        row_bytes, scale_bytes = stored_row_bytes(entry)
        half = buffer.nbytes // 2
        # a quantized tensor's scales follow all the rows: one small read of them first
        scales = self._read_exact(extent, entry, out * row_bytes, entry.nbytes, buffer).clone()
        scales = scales.view(out, scale_bytes)
        hasher = running_checksum() if self.verify else None

        def read(lo: int, at: int) -> torch.Tensor:  # on the reader thread, parts in order
            hi = min(lo + rows_per_read, out)
            part = self._read_exact(extent, entry, lo * row_bytes, hi * row_bytes, buffer, at)
            if hasher is not None:
                hasher.update(part.numpy().data)  # .data: the array's memoryview
            return part

        starts = range(0, out, rows_per_read)
        pending: Future[torch.Tensor] = self._reader.submit(read, 0, 0)
        try:
            for i, lo in enumerate(starts):
                part = pending.result()
                if i + 1 < len(starts):  # into the half the caller has finished with
                    pending = self._reader.submit(read, starts[i + 1], (i + 1) % 2 * half)
                rows = part.shape[0] // row_bytes
                if entry.format == "dense":
                    yield part.view(DTYPE_NAMES[entry.dtype]).view(rows, inputs)
                else:
                    yield QuantizedWeight.from_rows(
                        entry.format,  # type: ignore[arg-type]
                        part.view(rows, row_bytes),
                        scales[lo : lo + rows],
                    )
        finally:  # a caller that stops early must not find a read still filling its buffer
            pending.exception()
        if hasher is not None:
            hasher.update(scales.numpy().data)
            if hasher.intdigest() != entry.checksum:
                raise CorruptLayoutError(
                    f"{self.path}: checksum mismatch in tensor {entry.name!r}, {entry.nbytes} "
                    f"bytes at byte {extent.offset + entry.offset} (the file is corrupt; "
                    "convert again)"
                )

    def span_buffer_bytes(self, nbytes: int) -> int:
        """A buffer that holds any span of `nbytes` of a tensor as `read_span` reads it:
        widened to whole checksum chunks when verifying, and to alignment either side."""
        unit = CHUNK_BYTES if self.verify else ALIGNMENT
        return align_up(nbytes) + 2 * unit + 2 * ALIGNMENT

    def read_span(
        self, extent: Extent, entry: TensorEntry, lo: int, hi: int, buffer: AlignedBuffer
    ) -> torch.Tensor:
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
            self._check(chunk.numpy().data, expected, entry, tensor_start + at)
        return chunks[lo - first : hi - first]

    def _read_exact(
        self,
        extent: Extent,
        entry: TensorEntry,
        lo: int,
        hi: int,
        buffer: AlignedBuffer,
        at: int = 0,
    ) -> torch.Tensor:
        """Bytes lo:hi of a tensor of `extent` by one read of the aligned span around them,
        into `buffer` from its aligned byte `at`. -> [hi - lo] uint8, a view into `buffer`"""
        tensor_start = extent.offset + entry.offset
        read_from = tensor_start + lo
        read_from -= read_from % ALIGNMENT
        self._read_into(buffer, at, read_from, align_up(tensor_start + hi) - read_from)
        skip = at + tensor_start - read_from  # tensor byte b sits at buffer index skip + b
        return buffer.bytes[skip + lo : skip + hi]

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
