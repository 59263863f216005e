"""A compute unit runs every job on one thread of its own, for its whole life (units.py)."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import trio

from lever_actors.device.units import ComputeUnit


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
