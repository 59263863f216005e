"""A compute unit runs every job on one thread of its own, for its whole life (units.py)."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import trio

from lever_actors.device.units import Abandoned, ComputeUnit


async def test_every_job_runs_on_the_units_own_thread_never_the_event_loops():
    unit = ComputeUnit("npu")
    seen = [await unit.run(threading.get_ident) for _ in range(5)]
    assert len(set(seen)) == 1
    assert seen[0] != threading.get_ident()
    assert unit.jobs == 5
    unit.close()


async def test_two_units_run_side_by_side_on_two_threads():
    npu, cpu = ComputeUnit("npu"), ComputeUnit("cpu")
    both = threading.Barrier(2, timeout=5)  # passes only if both jobs run at once
    async with trio.open_nursery() as nursery:
        nursery.start_soon(npu.run, both.wait)
        nursery.start_soon(cpu.run, both.wait)
    npu.close()
    cpu.close()


async def test_jobs_on_one_unit_never_overlap():
    unit = ComputeUnit("npu")
    inside = []

    def job(i: int) -> None:
        inside.append(i)
        time.sleep(0.01)
        inside.append(-i)

    async with trio.open_nursery() as nursery:
        for i in range(1, 4):
            nursery.start_soon(unit.run, job, i)
    assert all(inside[k] == -inside[k + 1] for k in range(0, len(inside), 2))
    unit.close()


async def test_a_jobs_error_is_raised_as_itself():
    unit = ComputeUnit("cpu")
    with pytest.raises(ZeroDivisionError):
        await unit.run(lambda: 1 / 0)
    assert unit.running == 0
    assert await unit.run(lambda: 7) == 7  # the thread lives on
    unit.close()


async def test_a_yielding_job_runs_the_jobs_queued_meanwhile_at_its_pauses():
    unit = ComputeUnit("npu")
    started, events = threading.Event(), []

    def low_priority(pause) -> int:
        started.set()
        for _ in range(500):  # until the other job has run here, at most 5 s
            pause()
            if events:
                break
            time.sleep(0.01)
        events.append("low priority done")
        return threading.get_ident()

    async with trio.open_nursery() as nursery:
        thread = []

        async def run_low_priority() -> None:
            thread.append(await unit.run_yielding(low_priority))

        nursery.start_soon(run_low_priority)
        await trio.to_thread.run_sync(started.wait)
        other = await unit.run(lambda: (events.append("other"), threading.get_ident())[1])
    assert events == ["other", "low priority done"]  # not after the yielding job
    assert thread == [other]  # on the unit's thread, so in its OpenMP team
    assert unit.jobs == 2
    unit.close()


async def test_a_yielding_job_ends_at_its_next_pause_once_told_to():
    unit = ComputeUnit("npu")
    until, pauses = threading.Event(), []

    def long_job(pause) -> None:
        for i in range(500):  # 5 s, unless abandoned
            if i == 3:
                until.set()  # as the caller would, from another thread
            pause()
            pauses.append(i)
            time.sleep(0.01)

    with pytest.raises(Abandoned):
        await unit.run_yielding(long_job, until=until)
    assert pauses == [0, 1, 2]
    assert unit.running == 0 and await unit.run(lambda: 7) == 7  # the unit goes on
    unit.close()


async def test_a_timed_job_counts_its_own_time_not_its_wait_behind_another():
    unit = ComputeUnit("npu")
    started = threading.Event()

    def ahead() -> None:
        started.set()
        time.sleep(0.2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(unit.run, ahead)
        await trio.to_thread.run_sync(started.wait)
        waited = time.perf_counter()
        result, seconds = await unit.run_timed(time.sleep, 0.01)
        waited = time.perf_counter() - waited
    assert result is None
    assert 0.01 <= seconds < 0.1 <= waited  # it waited for most of the other job
    unit.close()


async def test_a_job_queued_beside_a_job_that_never_pauses_waits_for_it():
    unit = ComputeUnit("npu")
    started, events = threading.Event(), []

    def steady() -> None:
        started.set()
        time.sleep(0.05)
        events.append("steady")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(unit.run, steady)
        await trio.to_thread.run_sync(started.wait)
        await unit.run(events.append, "queued")
    assert events == ["steady", "queued"]
    unit.close()


async def test_cancellation_waits_for_the_running_job():
    unit = ComputeUnit("npu")
    done = []
    with trio.move_on_after(0.01):
        await unit.run(lambda: (time.sleep(0.2), done.append(1)))
    assert done == [1]
    unit.close()


def test_close_and_dropping_a_unit_end_its_thread():
    closed, dropped = ComputeUnit("npu"), ComputeUnit("cpu")
    threads = [closed._thread, dropped._thread]
    closed.close()
    del dropped
    gc.collect()
    threads[1].join(timeout=5)
    assert not any(t.is_alive() for t in threads)
