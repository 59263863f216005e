"""Where the library keeps what it fetches, converts and builds, and the lock that lets one
process at a time make each of them."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from lever_actors.errors import CheckpointError


def cache_key(parts: object) -> str:
    """A short name for what `parts` (JSON-able) identify, for a cache's files."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/lever_actors`, else `~/.cache/lever_actors`."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # the XDG spec says to ignore a relative value
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "lever_actors"


def path_bytes(path: Path) -> int:
    """A file's size, or the sum of the files under a directory."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


@contextmanager
def exclusive(directory: Path, on_wait: Callable[[], object] = lambda: None) -> Iterator[None]:
    """Hold the lock of `directory` (made if missing) for the block: another process's block
    on it waits until this one ends, calling `on_wait` first. The lock is an flock on the
    directory itself, so it leaves no file behind, and the kernel drops it however its
    holder dies."""
    directory.mkdir(parents=True, exist_ok=True)
    held = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(held, fcntl.LOCK_EX)
        yield
    finally:
        os.close(held)  # releases the lock


def file_identity(path: Path) -> list[str | int]:
    """What tells one version of a file from another, for cache keys: its resolved path,
    size and modification time (its path alone where it cannot be read)."""
    try:
        stat = path.stat()
    except OSError:
        return [str(path)]
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def file_inside(directory: Path, name: object, what: str) -> Path:
    """`directory / name` for a file name read from the checkpoint's own metadata, which
    must name a file inside the directory: no absolute path, no way out through '..'.
    (Links the user placed in the directory are the user's to make.)"""
    if not isinstance(name, str) or not name or Path(name).is_absolute():
        raise CheckpointError(f"{directory}: {what} {name!r} is not a file name in it")
    if os.path.normpath(name).split(os.sep)[0] == "..":
        raise CheckpointError(f"{directory}: {what} {name!r} points outside the directory")
    return directory / name
