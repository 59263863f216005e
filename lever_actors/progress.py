"""A one-line progress display for long work on a terminal (fetching, converting, benchmarks)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

Progress = Callable[[int, int, str], None]  # (done, total, label): what long work reports


class ProgressLine:
    """Redraws `label  done/total  rate` in place; prints nothing when the stream is not a tty
    except a final line, so logs stay readable."""

    def __init__(self, stream: TextIO | None = None, unit: str = "B") -> None:
        self.stream = stream or sys.stderr  # looked up now: tests and tools swap sys.stderr
        self.unit = unit
        self.started = time.monotonic()
        self.last_draw = 0.0
        self.interactive = self.stream.isatty()

    def __call__(self, done: int, total: int, label: str) -> None:
        now = time.monotonic()
        finished = done >= total
        if not finished and (not self.interactive or now - self.last_draw < 0.1):
            return
        self.last_draw = now
        rate = done / max(now - self.started, 1e-9)
        line = f"{label}  {_human(done)}/{_human(total)}{self.unit}  {_human(rate)}{self.unit}/s"
        end = "\n" if finished else ""
        self.stream.write(("\r\x1b[2K" if self.interactive else "") + line + end)
        self.stream.flush()
        if finished:
            self.started = time.monotonic()


def _human(n: float) -> str:
    for prefix in ("", "Ki", "Mi", "Gi"):
        if n < 1024:
            return f"{n:.1f}{prefix}" if prefix else f"{n:.0f}"
        n /= 1024
    return f"{n:.1f}Ti"
