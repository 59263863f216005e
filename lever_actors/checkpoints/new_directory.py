"""Writing an output so that an interrupted write leaves nothing that loads, and so that the
partial outputs of a killed process are removed by the next run."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lever_actors.errors import CheckpointError
from lever_actors.logs import get_logger

log = get_logger(__name__)


@contextmanager
def new_directory(out: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `out` (which must not exist yet); it is renamed to
    `out` when the block succeeds and removed when it fails. Partial outputs of `out` that
    killed processes left are removed first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    if out.exists():
        raise CheckpointError(f"{out}: already exists; remove it or choose another output")
    tmp = partial_path(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def partial_path(out: Path, kind: str = "partial") -> Path:
    """Where this process writes `out` (or keeps its `kind` of scratch files) before the
    result is complete: a hidden sibling named with our PID, so a later run can tell whether
    its writer still lives."""
    return out.with_name(f".{out.name}.{kind}-{os.getpid()}")


def remove_stale_partials(out: Path) -> None:
    """Remove the `partial_path`s of `out` whose process has died (SIGKILL, power loss:
    nothing of theirs ran to clean up)."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.[a-z]+-(\d+)")
    for path in out.parent.iterdir():
        match = pattern.fullmatch(path.name)
        if match is None or _alive(int(match[1])):
            continue
        log.info("stale_partial.removed", path=str(path), dead_pid=match[1])
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True
