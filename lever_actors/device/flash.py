"""A flash layout's extents as torch's weights: views of the aligned buffers the reader
beneath fills (device/reads.py), whole extents, the embedding table's rows and the LM head
streamed by rows."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lever_actors.device.checksums import running_checksum
from lever_actors.device.layout import DTYPE_NAMES, weight_of
from lever_actors.device.manifest import (
    ROW_STREAMED_FORMATS,
    Extent,
    TensorEntry,
    stored_row_bytes,
)
from lever_actors.device.reads import AlignedBuffer, LayoutReader
from lever_actors.errors import CorruptLayoutError
from lever_actors.model.quantized import QuantizedWeight, decode_rows
from lever_actors.model.weights import Weight


class FlashStore(LayoutReader):
    """A layout's reads as torch's weights: whole extents, rows of the embedding table, and
    the LM head streamed by rows (the reader beneath checks every byte, as LayoutReader)."""

    @functools.cached_property
    def _reader(self) -> ThreadPoolExecutor:
        """Reads the next part of a streamed tensor while the caller uses this one."""
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="flash-stream")

    def close(self) -> None:
        """Idempotent."""
        if "_reader" in self.__dict__:  # started by a stream
            self._reader.shutdown()
        super().close()

    def read_extent(
        self, extent: Extent, buffer: AlignedBuffer, *, check: bool = True
    ) -> dict[str, Weight]:
        """Blocking: one sequential read of the whole extent; tensors are views into `buffer`.
        With `check=False` the caller must `check_extent` before it uses them."""
        self.read_bytes(extent, buffer, check=check)
        return tensors_of(extent, buffer)

    def load_extent(self, extent: Extent) -> dict[str, Weight]:
        """Read an extent into its own new buffer, for weights that stay resident."""
        return tensors_of(extent, self.load_bytes(extent))

    def load_extents(self, extents: Sequence[Extent]) -> list[dict[str, Weight]]:
        """Read extents into their own new buffers (`load_all`), for weights that stay
        resident."""
        buffers = self.load_all(extents)
        return [tensors_of(e, b) for e, b in zip(extents, buffers, strict=True)]

    def read_rows(self, extent: Extent, rows: list[int]) -> torch.Tensor:
        """Rows of a 2-D single-tensor extent (the embedding table), each by its own small read
        (`row_records`) -> [len(rows), row_width] in the table's dtype (a quantized table's
        rows decoded)"""
        (entry,) = extent.tensors
        records = torch.from_numpy(self.row_records(extent, rows))  # [len(rows), row_bytes]
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
        scales = torch.from_numpy(
            self._read_exact(extent, entry, out * row_bytes, entry.nbytes, buffer).copy()
        )
        scales = scales.view(out, scale_bytes)
        hasher = running_checksum() if self.verify else None

        def read(lo: int, at: int) -> torch.Tensor:  # on the reader thread, parts in order
            hi = min(lo + rows_per_read, out)
            part = torch.from_numpy(
                self._read_exact(extent, entry, lo * row_bytes, hi * row_bytes, buffer, at)
            )
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


def tensors_of(extent: Extent, buffer: AlignedBuffer) -> dict[str, Weight]:
    """An extent's tensors, viewed in place in the buffer it was read into."""
    return {t.name: tensor_of(buffer, t) for t in extent.tensors}


def tensor_of(buffer: AlignedBuffer, entry: TensorEntry, base: int = 0) -> Weight:
    """A zero-copy view of one tensor stored at `base + entry.offset` in `buffer`."""
    start = base + entry.offset
    return weight_of(entry, torch.from_numpy(buffer.array)[start : start + entry.nbytes])
