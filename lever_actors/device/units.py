"""Compute units: where actors run torch work, never on the event loop.

"npu" is the batched unit (the accelerator if there were one; here a CPU worker thread),
"cpu" a second worker for small irregular work. Each runs its jobs one at a time, in the
order they came, on its own thread, so the two units run side by side. A job of low
priority (a draft round ahead) runs with `run_yielding`: at each pause it offers (between
layers), the unit first runs every job queued since, so that a verifier's layer waits
for a fraction of a forward, not a whole one; and once its caller sets `until`, the job
ends there with `Abandoned`, so that nothing waits for the rest of a round no longer wanted.

Each unit owns one OS thread for its whole life, so its products always start the same
OpenMP team, and the engine loads and profiles on the "npu" unit too. libgomp spins idle
team threads between products only while it manages no more threads than there are
cores; each further thread that ever started a team (a trio cache thread, the event
loop's thread) makes every team sleep after each product instead: the real target's
memory-resident loop decoded 15-25% slower with a second team alive (docs/benchmarks.md).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import outcome
import trio

T = TypeVar("T")


class Abandoned(Exception):
    """Raised at a yielding job's pause once its `until` is set: the job stops there."""


class ComputeUnit:
    def __init__(self, name: str) -> None:
        self.name = name
        self.jobs = 0
        self.running = 0  # jobs inside the unit's thread right now (a yielding one's included)
        jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._jobs = jobs
        self._thread = threading.Thread(
            target=_serve, args=(jobs,), name=f"lever-{name}", daemon=True
        )
        self._thread.start()
        self._stop = weakref.finalize(self, jobs.put, None)  # a unit dropped unclosed ends too
        self._stop.atexit = False  # at exit a woken thread would be killed mid-way (abort)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run fn(*args) on the unit's thread; cancellation waits for the job to finish."""
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()
        result: list[outcome.Outcome[T]] = []

        def job() -> None:
            result.append(outcome.capture(self._counted, fn, *args))
            token.run_sync_soon(trio.lowlevel.reschedule, task)

        self._jobs.put(job)
        await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        return result[0].unwrap()

    async def run_timed(self, fn: Callable[..., T], *args: object) -> tuple[T, float]:
        """As `run`, with the seconds fn itself took: not its wait behind the unit's other
        jobs (a round drafted ahead's layer, when a verifier's layer comes)."""
        return await self.run(_timed, fn, *args)

    async def run_yielding(
        self, fn: Callable[..., T], *args: object, until: threading.Event | None = None
    ) -> T:
        """Run fn(*args, pause=...) on the unit's thread, where fn calls pause() wherever the
        jobs queued meanwhile may run first (on this thread, so in the same OpenMP team).
        Once `until` is set, the next pause raises Abandoned instead."""

        def pause() -> None:
            if until is not None and until.is_set():
                raise Abandoned
            self._run_queued()

        return await self.run(partial(fn, pause=pause), *args)

    def close(self) -> None:
        """End the unit's thread once its queued jobs are done (OpenMP frees its team)."""
        self._stop()
        self._thread.join()

    def _counted(self, fn: Callable[..., T], *args: object) -> T:
        self.running += 1
        try:
            return fn(*args)
        finally:
            self.jobs += 1
            self.running -= 1

    def _run_queued(self) -> None:
        """On the unit's thread, inside a yielding job: run the jobs queued so far."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:  # closing: the thread's loop ends once this job returns
                self._jobs.put(None)
                return
            job()


def _timed(fn: Callable[..., T], *args: object) -> tuple[T, float]:
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


def _serve(jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    """A unit's thread: its jobs in order, until None (it holds no reference to the unit)."""
    while (job := jobs.get()) is not None:
        job()
