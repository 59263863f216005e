"""The batch's places (engine/batch.py): arrival order, at most `parallel`, the KV room held, a
request cancelled in line leaving no trace, and a shared failure reaching every place."""

from __future__ import annotations

import trio
from trio.testing import wait_all_tasks_blocked

from lever_actors.channels.messages import Beside
from lever_actors.engine.batch import Batch

TIMEOUT = 10


async def hold(batch: Batch, name: str, kv: int, order: list, release: trio.Event) -> None:
    async with batch.place(kv) as place:
        order.append((name, place.seat))
        await release.wait()


async def test_places_go_in_arrival_order_within_parallel_and_the_kv_room():
    batch = Batch(parallel=2, room_tokens=100)
    order: list = []
    releases = {name: trio.Event() for name in "abcd"}
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            for name, kv in zip("abcd", (40, 40, 10, 10), strict=True):
                nursery.start_soon(hold, batch, name, kv, order, releases[name])
                await wait_all_tasks_blocked()  # in this order
            assert [n for n, _ in order] == ["a", "b"]  # two places
            assert (batch.active, batch.queued) == (2, 2)
            releases["a"].set()
            await wait_all_tasks_blocked()
            assert [n for n, _ in order] == ["a", "b", "c"]  # c in a's place, d behind it
            releases["b"].set()
            await wait_all_tasks_blocked()
            assert [n for n, _ in order] == ["a", "b", "c", "d"]
            for release in releases.values():
                release.set()
    assert [seat for _, seat in order] == [0, 1, 2, 3]
    assert (batch.active, batch.queued) == (0, 0)


async def test_a_request_waits_while_its_kv_does_not_fit_beside_the_others():
    batch = Batch(parallel=4, room_tokens=100)
    order: list = []
    releases = [trio.Event() for _ in range(3)]
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold, batch, "big", 80, order, releases[0])
            await wait_all_tasks_blocked()
            nursery.start_soon(hold, batch, "fits-not", 30, order, releases[1])
            await wait_all_tasks_blocked()
            nursery.start_soon(hold, batch, "small", 10, order, releases[2])  # fits, but waits
            await wait_all_tasks_blocked()
            assert [n for n, _ in order] == ["big"]  # arrival order: nobody overtakes
            releases[0].set()
            await wait_all_tasks_blocked()
            by_seat = sorted(order, key=lambda taken: taken[1])  # admitted in this order
            assert [n for n, _ in by_seat] == ["big", "fits-not", "small"]
            for release in releases:
                release.set()


async def test_a_request_cancelled_at_the_head_of_the_line_lets_those_behind_it_in():
    batch = Batch(parallel=4, room_tokens=100)
    order: list = []
    releases = [trio.Event() for _ in range(2)]
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold, batch, "big", 80, order, releases[0])
            await wait_all_tasks_blocked()
            head = trio.CancelScope()
            nursery.start_soon(hold_in, head, batch, 30)  # cannot fit beside "big"
            await wait_all_tasks_blocked()
            nursery.start_soon(hold, batch, "small", 10, order, releases[1])
            await wait_all_tasks_blocked()
            assert [n for n, _ in order] == ["big"]  # behind the head
            head.cancel()
            await wait_all_tasks_blocked()
            assert [n for n, _ in order] == ["big", "small"]  # fits, and now first
            for release in releases:
                release.set()


async def hold_in(scope: trio.CancelScope, batch: Batch, kv: int) -> None:
    with scope:
        async with batch.place(kv):
            raise AssertionError("it never fits")


async def test_a_request_alone_always_gets_a_place_whatever_its_kv():
    batch = Batch(parallel=2, room_tokens=10)
    with trio.fail_after(TIMEOUT):
        async with batch.place(500) as place:
            assert place.seat == 0 and batch.active == 1


async def test_a_place_holds_what_the_room_had_where_it_had_less_than_asked():
    batch = Batch(parallel=2, room_tokens=100)
    with trio.fail_after(TIMEOUT):
        async with batch.place(70) as first, batch.place(50, least_tokens=20) as second:
            assert (first.kv_tokens, second.kv_tokens) == (70, 30)
            assert batch.free_tokens == 0


async def test_a_request_cancelled_in_line_leaves_it():
    batch = Batch(parallel=1, room_tokens=100)
    order: list = []
    first = trio.Event()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold, batch, "a", 10, order, first)
            await wait_all_tasks_blocked()
            with trio.move_on_after(0.05):
                async with batch.place(10):
                    raise AssertionError("no place while a holds the only one")
            assert batch.queued == 0  # gone from the line
            first.set()
    async with batch.place(10) as place:
        assert place.seat == 1  # the cancelled one never took a seat


async def test_beside_sums_the_other_places_last_trees_and_fail_reaches_its_crew_s():
    batch = Batch(parallel=3, room_tokens=100)
    error = RuntimeError("the verifier broke")
    with trio.fail_after(TIMEOUT):
        async with batch.place(10) as a, batch.place(10) as b, batch.place(10) as c:
            a.last, b.last, c.last = Beside(0, 5, 2.0), Beside(0, 7, 3.0), Beside(0, 1, 1.0)
            assert batch.beside(a) == Beside(2, 8, 4.0)
            crew, next_crew = trio.Event(), trio.Event()
            a.crew = b.crew = crew
            c.crew = next_crew  # joined a crew after the failing one closed its doors
            batch.fail(error, crew)
            batch.fail(RuntimeError("a peer that saw its channel close"), crew)
            assert [p.failure for p in (a, b, c)] == [error, error, None]  # the first one's
            assert [p.scope.cancel_called for p in (a, b, c)] == [True, True, False]
