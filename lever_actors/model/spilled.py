"""A draft's tied table with the rows it never proposes on disk.

A draft that proposes from the first `vocabulary` ids (EngineConfig.draft_vocabulary)
multiplies only those rows of its table; the others serve embedding lookups of the
context's rarer tokens, a few a step. They go to a file in the cache, named by their
content, and are read per lookup through a memory map: under a memory limit their DRAM
(77 MB of the real draft's 136 MB int8 table) is left to the target's layers.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace

import numpy as np
import torch

from lever_actors.model.quantized import QuantizedWeight
from lever_actors.paths import default_cache_dir


@dataclass(frozen=True, eq=False)
class SpilledTable:
    """An embedding table [rows, d]: rows below `resident`'s count in DRAM (the draft's LM
    head too), the others' bytes in a file (a quantized table's scales in DRAM)."""

    shape: tuple[int, int]
    resident: torch.Tensor | QuantizedWeight
    spilled: np.ndarray  # memory map [rows - resident rows, row bytes] uint8
    spilled_scales: torch.Tensor | None  # a quantized table's, for the spilled rows

    @property
    def dtype(self) -> torch.dtype:
        return self.resident.dtype

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of these token ids, [n] -> [n, d], as the whole table gives them."""
        kept = self.resident.shape[0]
        if len(ids) == 0 or int(ids.max()) < kept:
            return self.resident[ids]
        out = torch.empty(len(ids), self.shape[1], dtype=self.dtype)
        low = ids < kept
        out[low] = self.resident[ids[low]]
        out[~low] = self._spilled_rows(ids[~low] - kept)
        return out

    def _spilled_rows(self, far: torch.Tensor) -> torch.Tensor:
        raw = torch.from_numpy(np.ascontiguousarray(self.spilled[far.numpy()]))
        if isinstance(self.resident, torch.Tensor):
            return raw.view(self.resident.dtype)
        assert self.spilled_scales is not None  # a quantized table's
        rows = replace(
            self.resident,
            shape=(len(far), self.shape[1]),
            data=raw.view(self.resident.data.dtype),
            scales=self.spilled_scales[far],
        )
        return rows[torch.arange(len(far))]

    @property
    def held(self) -> tuple:
        """What it holds in DRAM, part by part (the resident rows are the draft's head)."""
        scales = () if self.spilled_scales is None else (self.spilled_scales,)
        return (self.resident, *scales)

    @property
    def nbytes(self) -> int:
        """Bytes in DRAM: the file's rows are not."""
        return sum(part.nbytes for part in self.held)


def spill_rows(table, kept: int | None) -> SpilledTable | None:
    """The table with rows from `kept` on in a file; None where it has no more rows, or its
    rows cannot be read one by one (a 4-bit table stays whole)."""
    quantized = isinstance(table, QuantizedWeight)
    if kept is None or not (isinstance(table, torch.Tensor) or quantized and table.rows_readable):
        return None
    rows, d = table.shape
    if kept >= rows:
        return None
    data = table.data if quantized else table
    far = data[kept:].contiguous().view(torch.uint8).numpy()
    spilled = np.memmap(_file_of(far), dtype=np.uint8, mode="r", shape=far.shape)
    if not quantized:
        return SpilledTable(table.shape, table[:kept].clone(), spilled, None)
    resident = replace(
        table, shape=(kept, d), data=table.data[:kept].clone(), scales=table.scales[:kept].clone()
    )
    return SpilledTable(table.shape, resident, spilled, table.scales[kept:].clone())


def _file_of(rows: np.ndarray) -> str:
    """A file in the cache holding these bytes, written once: named by their content, so a
    file that exists holds them."""
    key = hashlib.sha256(rows.data).hexdigest()[:24]  # .data: the array's memoryview
    path = default_cache_dir() / "spilled-rows" / f"{key}.bin"
    if not path.exists() or path.stat().st_size != rows.nbytes:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        rows.tofile(partial)
        partial.replace(path)  # whole or absent, whoever writes beside us
    return str(path)
