"""Prefixes' KV spilled to a directory (`--prompt-cache-dir`), so that a restart or a
conversation the DRAM cache let go of resumes without its prefill.

One file a prefix: an 8-byte header length, the header's XXH3-64 checksum (8 bytes), a
msgpack header (the tokens, where the draft's KV starts, each tensor's dtype, shape and
checksum), then the tensors' bytes. Only a regular file is opened (never through a link, a
FIFO or a device), and it is used only where its size is the header's to the byte, its
header and tensors match their checksums and its shapes and dtypes are the models'; a file
that fails is removed (skipped where it cannot be) with one warning and counts as absent.
Files are written under a partial name and renamed when whole; a dead writer's partial
files are removed, a live one's counted. A directory the process may not write is read,
never written. The directory is one of many under `root`, named by a key of the weights
and the machine (KV computed by other weights or other kernels would not match, bit for
bit).
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NamedTuple, TypeVar

import msgspec
import torch

from lever_actors.device.checksums import checksum
from lever_actors.logs import get_logger
from lever_actors.model.args import ModelArgs
from lever_actors.model.kv_cache import KVPrefix

log = get_logger(__name__)

HEADER_LENGTH_BYTES = 8
HEADER_CHECKSUM_BYTES = 8
PREAMBLE_BYTES = HEADER_LENGTH_BYTES + HEADER_CHECKSUM_BYTES
MAX_HEADER_BYTES = 16 << 20  # a header of a million tokens takes about 5 MB
SUFFIX = ".kv"
# another key's directory none of whose files was written or used for this long goes: its
# weights, dtypes, machine or kernels have changed since (each change is a new key)
STALE_KEY_SECONDS = 30 * 24 * 3600
_TENSORS = ("keys", "values", "positions")
T = TypeVar("T")


class TensorRecord(msgspec.Struct, frozen=True):
    dtype: str  # torch's name without "torch.", e.g. "bfloat16"
    shape: tuple[Annotated[int, msgspec.Meta(ge=0)], ...]
    checksum: int


class KVShape(NamedTuple):
    """What one model's KV of n tokens looks like: keys and values [layers, kv_heads, n,
    head_dim] of `dtype`, positions [n] of int64."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # as TensorRecord names it

    @classmethod
    def of(cls, args: ModelArgs, dtype: torch.dtype) -> KVShape:
        name = str(dtype).removeprefix("torch.")
        return cls(args.n_layers, args.n_kv_heads, args.head_dim, name)

    def fits(self, records: tuple[TensorRecord, ...], tokens: int) -> bool:
        kv = (self.layers, self.kv_heads, tokens, self.head_dim)
        expected = [(self.dtype, kv), (self.dtype, kv), ("int64", (tokens,))]
        return [(r.dtype, r.shape) for r in records] == expected


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
    files written longest ago go first. `shapes`: the target's KV and the draft's (None
    without a draft), which a file's tensors must have. Blocking: a compute unit's thread
    calls it."""

    def __init__(
        self, root: Path, key: str, capacity_bytes: int, shapes: tuple[KVShape, KVShape | None]
    ) -> None:
        self.directory = root / key
        self.capacity_bytes = capacity_bytes
        self.shapes = shapes
        self.index: dict[tuple[int, ...], Path] = {}  # tokens -> file, from the headers
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            log.warning("prompt_cache.unusable", directory=str(self.directory), error=str(error))
            self.writable = False
            return
        self.writable = os.access(self.directory, os.W_OK)
        if not self.writable:  # said once: what it holds is read, nothing is written
            log.warning("prompt_cache.read_only", directory=str(self.directory))
        self._remove_dead_partials()
        self._remove_stale_keys(root)
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            header = self._checked(path, _header_of)
            if header is not None:
                self.index[header.tokens] = path

    def save(self, prefix: CachedPrefix) -> None:
        """Write `prefix` (unless a file holds it or a longer text that starts with it), then
        drop files of the prefixes it extends and the oldest until all fit."""
        if not self.writable:
            return
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
                out.write(checksum(encoded).to_bytes(HEADER_CHECKSUM_BYTES, "little"))
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
        prefix = self._checked(path, self._prefix_of)
        if prefix is None or prefix.tokens != tokens:
            if prefix is not None:
                log.warning("prompt_cache.unreadable", path=str(path), error="other tokens")
            self._remove(tokens)
            return None
        try:
            os.utime(path)  # used: the last to go
        except OSError:
            pass  # a directory read, not written: its order stays
        return prefix

    def _prefix_of(self, file: _File) -> CachedPrefix:
        header = _header_of(file)
        target_shape, draft_shape = self.shapes
        if not target_shape.fits(header.target, len(header.tokens)):
            raise ValueError("its target KV is not the model's shape or dtype")
        if (header.draft is None) != (draft_shape is None):
            raise ValueError("it holds a draft's KV where the engine has no draft, or none")
        drafted = len(header.tokens) - header.draft_start
        if header.draft is not None and not (
            draft_shape is not None and draft_shape.fits(header.draft, drafted)
        ):
            raise ValueError("its draft KV is not the model's shape or dtype")
        records = header.target + (header.draft or ())
        expected = file.data_start + sum(_nbytes(r) for r in records)
        if file.size != expected:  # checked before the tensors are read
            raise ValueError(f"it holds {file.size} bytes where its header says {expected}")
        view = memoryview(file.read(file.size - file.data_start))
        target, view = _read(header.target, view)
        draft = None
        if header.draft is not None:
            draft, view = _read(header.draft, view)
        return CachedPrefix(header.tokens, target, draft, header.draft_start)

    @property
    def nbytes(self) -> int:
        """The spilled files' bytes, and those of partial files a live writer is writing."""
        partials = self.directory.glob(f".*{SUFFIX}.*")
        return sum(_size(path) for path in [*self.index.values(), *partials])

    def _fit(self) -> None:
        by_age = sorted(self.index, key=lambda t: _mtime(self.index[t]))
        total = self.nbytes
        while total > self.capacity_bytes and by_age:
            oldest = by_age.pop(0)
            total -= _size(self.index[oldest])
            self._remove(oldest)

    def _remove(self, tokens: tuple[int, ...]) -> None:
        _unlink(self.index.pop(tokens))

    def _checked(self, path: Path, read: Callable[[_File], T]) -> T | None:
        """`read` of the regular file at `path`; None, with one warning and the file removed
        (where it can be), where it is not one or fails a check."""
        try:
            with _File.open(path) as file:
                return read(file)
        except (OSError, ValueError, msgspec.DecodeError, msgspec.ValidationError) as error:
            log.warning("prompt_cache.unreadable", path=str(path), error=str(error))
            _unlink(path)
            return None

    def _remove_stale_keys(self, root: Path) -> None:
        """Other keys' directories whose files were all written or used STALE_KEY_SECONDS
        ago or more: their prefix files go, and the directory where nothing else is in it."""
        now = time.time()
        for other in root.iterdir():
            if other == self.directory or other.is_symlink() or not other.is_dir():
                continue
            files = list(other.glob(f"*{SUFFIX}"))
            if files and all(now - _mtime(f) / 1e9 >= STALE_KEY_SECONDS for f in files):
                log.info("prompt_cache.stale_key_removed", directory=str(other))
                for path in files:
                    _unlink(path)
                try:
                    other.rmdir()
                except OSError:
                    pass  # something else lives there: it stays

    def _remove_dead_partials(self) -> None:
        """A killed writer's partial files (`.NAME.kv.PID`) go; a live one's stay."""
        for path in self.directory.glob(f".*{SUFFIX}.*"):
            pid = path.name.rpartition(".")[2]
            if not pid.isdigit() or not _alive(int(pid)):
                _unlink(path)


class _File:
    """A prefix file opened for checking: a regular file, never through a link, a FIFO or
    a device, its size known before anything is read."""

    def __init__(self, descriptor: int, size: int) -> None:
        self._file = os.fdopen(descriptor, "rb")
        self.size = size
        self.data_start = PREAMBLE_BYTES  # where the tensors start, once the header is read

    @classmethod
    def open(cls, path: Path) -> _File:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        descriptor = os.open(path, flags)  # a link: ELOOP; a FIFO: no writer to wait for
        try:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode):
                raise ValueError("it is not a regular file")
        except BaseException:
            os.close(descriptor)
            raise
        return cls(descriptor, status.st_size)

    def read(self, n: int) -> bytes:
        data = self._file.read(n)
        if len(data) != n:
            raise ValueError("it ends early")
        return data

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def _header_of(file: _File) -> Header:
    """The header, its length bounded by the file's size and checked against its checksum."""
    if file.size < PREAMBLE_BYTES:
        raise ValueError("it ends before its header")
    preamble = file.read(PREAMBLE_BYTES)
    length = int.from_bytes(preamble[:HEADER_LENGTH_BYTES], "little")
    if length > min(MAX_HEADER_BYTES, file.size - PREAMBLE_BYTES):
        raise ValueError(f"its header length {length} passes its size")
    encoded = file.read(length)
    if checksum(encoded) != int.from_bytes(preamble[HEADER_LENGTH_BYTES:], "little"):
        raise ValueError("its header's checksum does not match")
    file.data_start = PREAMBLE_BYTES + length
    return msgspec.msgpack.decode(encoded, type=Header)


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


def _nbytes(record: TensorRecord) -> int:
    dtype = getattr(torch, record.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {record.dtype!r}")
    return dtype.itemsize * math.prod(record.shape)


def _read(records: tuple[TensorRecord, ...], view: memoryview) -> tuple[KVPrefix, memoryview]:
    """The KVPrefix at the start of `view`, its sizes already checked, and the bytes after."""
    tensors = []
    for record in records:
        dtype = getattr(torch, record.dtype)
        nbytes = _nbytes(record)
        piece, view = view[:nbytes], view[nbytes:]
        if checksum(piece) != record.checksum:
            raise ValueError("a checksum does not match")
        if nbytes:
            flat = torch.frombuffer(bytearray(piece), dtype=dtype)
        else:  # frombuffer refuses an empty buffer
            flat = torch.empty(0, dtype=dtype)
        tensors.append(flat.reshape(record.shape))
    return KVPrefix(*tensors), view


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass  # a directory read, not written: the file is skipped, not used


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


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
