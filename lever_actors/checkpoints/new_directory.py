"""Writing an output directory so that an interrupted write leaves nothing that loads."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lever_actors.errors import CheckpointError


@contextmanager
def new_directory(out: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `out` (which must not exist yet); it is renamed to
    `out` when the block succeeds and removed when it fails."""
    if out.exists():
        raise CheckpointError(f"{out}: already exists; remove it or choose another output")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
