"""Prefixes' KV spilled to a directory (`--prompt-cache-dir`), so that a restart or a
conversation the DRAM cache let go of resumes without its prefill.

One file a prefix: an 8-byte header length, a msgpack header (the tokens, where the
draft's KV starts, each tensor's dtype, shape and XXH3-64 checksum), then the tensors'
bytes. Every read is checked against its checksums before use; a file that fails is
removed and counts as absent. Files are written under a partial name and renamed when
whole. The directory is one of many under `root`, named by a key of the weights and the
machine (KV computed by other weights or other kernels would not match, bit for bit).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from lever_actors.device.checksums import checksum
from lever_actors.logs import get_logger
from lever_actors.model.kv_cache import KVPrefix

log = get_logger(__name__)

HEADER_LENGTH_BYTES = 8
SUFFIX = ".kv"
_TENSORS = ("keys", "values", "positions")


class TensorRecord(msgspec.Struct, frozen=True):
    dtype: str  # torch's name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    checksum: int


class Header(msgspec.Struct, frozen=True):
    tokens: tuple[int, ...]
    draft_start: int
    target: tuple[TensorRecord, ...]  # keys, values, positions
    draft: tuple[TensorRecord, ...] | None


@dataclass(frozen=True)
class CachedPrefix:
    """A finished request's text and the KV both models hold of it: the target's of all of
    it, the draft's of its tokens from `draft_start` on (the draft's view, engine/state.py)."""

    tokens: tuple[int, ...]
    target: KVPrefix
    draft: KVPrefix | None  # None without a draft model
    draft_start: int = 0

    @property
    def nbytes(self) -> int:
        return self.target.nbytes + (self.draft.nbytes if self.draft else 0)


class KVFiles:
    """The spilled prefixes of one key under `root`, at most `capacity_bytes` in all; the
    files written longest ago go first. Blocking: a compute unit's thread calls it."""

    def __init__(self, root: Path, key: str, capacity_bytes: int) -> None:
        self.directory = root / key
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.index: dict[tuple[int, ...], Path] = {}  # tokens -> file, from the headers
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            header = self._header(path)
            if header is not None:
                self.index[header.tokens] = path

    def save(self, prefix: CachedPrefix) -> None:
        """Write `prefix` (unless a file holds it or a longer text that starts with it), then
        drop files of the prefixes it extends and the oldest until all fit."""
        if any(tokens[: len(prefix.tokens)] == prefix.tokens for tokens in self.index):
            return
        target, draft = prefix.target, prefix.draft
        drafted = _records(draft) if draft is not None else None
        header = Header(prefix.tokens, prefix.draft_start, _records(target), drafted)
        parts = [_bytes(t) for kv in (target, draft) if kv is not None for t in _tensors(kv)]
        encoded = msgspec.msgpack.encode(header)
        path = self.directory / (_name(prefix.tokens) + SUFFIX)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            with open(partial, "wb") as out:
                out.write(len(encoded).to_bytes(HEADER_LENGTH_BYTES, "little"))
                out.write(encoded)
                for part in parts:
                    out.write(part)
            os.replace(partial, path)
        except OSError as error:
            partial.unlink(missing_ok=True)
            log.warning("prompt_cache.not_saved", path=str(path), error=str(error))
            return
        for tokens in [t for t in self.index if prefix.tokens[: len(t)] == t]:
            self._remove(tokens)
        self.index[prefix.tokens] = path
        self._fit()

    def longest(self, prompt: Sequence[int]) -> tuple[tuple[int, ...] | None, int]:
        """The spilled text that shares the most tokens with `prompt`, and how many."""
        return longest_shared(self.index, prompt)

    def load(self, tokens: tuple[int, ...]) -> CachedPrefix | None:
        """The prefix of `tokens` read back and checked; None (and its file removed) where the
        file is gone or fails its checks."""
        path = self.index[tokens]
        try:
            data = path.read_bytes()
            length = int.from_bytes(data[:HEADER_LENGTH_BYTES], "little")
            end = HEADER_LENGTH_BYTES + length
            header = msgspec.msgpack.decode(data[HEADER_LENGTH_BYTES:end], type=Header)
            view = memoryview(data)[end:]
            target, view = _read(header.target, view)
            draft = None
            if header.draft is not None:
                draft, view = _read(header.draft, view)
            if len(view) or header.tokens != tokens:
                raise ValueError("its length does not match its header")
        except (OSError, ValueError, msgspec.DecodeError, msgspec.ValidationError) as error:
            log.warning("prompt_cache.unreadable", path=str(path), error=str(error))
            self._remove(tokens)
            return None
        os.utime(path)  # used: the last to go
        return CachedPrefix(header.tokens, target, draft, header.draft_start)

    @property
    def nbytes(self) -> int:
        return sum(_size(path) for path in self.index.values())

    def _fit(self) -> None:
        by_age = sorted(self.index, key=lambda t: _mtime(self.index[t]))
        total = self.nbytes
        while total > self.capacity_bytes and by_age:
            oldest = by_age.pop(0)
            total -= _size(self.index[oldest])
            self._remove(oldest)

    def _remove(self, tokens: tuple[int, ...]) -> None:
        self.index.pop(tokens).unlink(missing_ok=True)

    def _header(self, path: Path) -> Header | None:
        try:
            with open(path, "rb") as file:
                length = int.from_bytes(file.read(HEADER_LENGTH_BYTES), "little")
                return msgspec.msgpack.decode(file.read(length), type=Header)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as error:
            log.warning("prompt_cache.unreadable", path=str(path), error=str(error))
            path.unlink(missing_ok=True)
            return None


def longest_shared(
    texts: Iterable[tuple[int, ...]], prompt: Sequence[int]
) -> tuple[tuple[int, ...] | None, int]:
    """Of `texts`, the one that shares the most tokens with `prompt` from its start, and
    how many (None and 0 where none shares any)."""
    best, shared = None, 0
    for text in texts:
        n = _common_length(text, prompt)
        if n > shared:
            best, shared = text, n
    return best, shared


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` share from the start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _name(tokens: tuple[int, ...]) -> str:
    return hashlib.sha256(msgspec.msgpack.encode(tokens)).hexdigest()[:32]


def _tensors(prefix: KVPrefix) -> tuple[torch.Tensor, ...]:
    return tuple(getattr(prefix, name) for name in _TENSORS)


def _bytes(tensor: torch.Tensor) -> memoryview:
    return tensor.contiguous().view(torch.uint8).numpy().data.cast("B")


def _records(prefix: KVPrefix) -> tuple[TensorRecord, ...]:
    return tuple(
        TensorRecord(str(t.dtype).removeprefix("torch."), tuple(t.shape), checksum(_bytes(t)))
        for t in _tensors(prefix)
    )


def _read(records: tuple[TensorRecord, ...], view: memoryview) -> tuple[KVPrefix, memoryview]:
    """The KVPrefix at the start of `view`, checked, and the bytes after it."""
    tensors = []
    for record in records:
        dtype = getattr(torch, record.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {record.dtype!r}")
        nbytes = dtype.itemsize * math.prod(record.shape)
        if len(view) < nbytes:
            raise ValueError("it ends early")
        piece, view = view[:nbytes], view[nbytes:]
        if checksum(piece) != record.checksum:
            raise ValueError("a checksum does not match")
        if nbytes:
            flat = torch.frombuffer(bytearray(piece), dtype=dtype)
        else:  # frombuffer refuses an empty buffer
            flat = torch.empty(0, dtype=dtype)
        tensors.append(flat.reshape(record.shape))
    return KVPrefix(*tensors), view


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0
