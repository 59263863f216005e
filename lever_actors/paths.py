"""Where the library keeps what it fetches, converts and builds."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/lever_actors`, else `~/.cache/lever_actors`."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # the XDG spec says to ignore a relative value
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "lever_actors"
