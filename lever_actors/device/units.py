"""Compute units: where actors run torch work, never on the event loop.

"npu" is the batched unit (the accelerator if there were one; here a CPU worker thread),
"cpu" a second worker for small irregular work. Each admits one job at a time through its
CapacityLimiter, so work on one unit is serialised and the two units run side by side.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")


class ComputeUnit:
    def __init__(self, name: str) -> None:
        self.name = name
        self.limiter = trio.CapacityLimiter(1)
        self.busy_seconds = 0.0
        self.jobs = 0
        self.running = 0  # jobs inside a worker thread right now

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run fn(*args) in a worker thread; cancellation waits for the job to finish."""
        return await trio.to_thread.run_sync(self._timed, fn, *args, limiter=self.limiter)

    def _timed(self, fn: Callable[..., T], *args: object) -> T:
        self.running += 1
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.busy_seconds += time.perf_counter() - started
            self.jobs += 1
            self.running -= 1
