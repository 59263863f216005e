"""The requests decoding together (EngineConfig.parallel): who holds a place in the batch
and who waits for one, in arrival order, and what each put in its last pass, by which the
others size their trees.

Who takes a place is the scheduler's decision (policy/schedule.py Places: in arrival order,
within `parallel` and the KV room the context leaves); this module waits for it and keeps
each place's state. A request leaves at its end, and the next in line may enter. The
verifier seats a placed request from the pass after it asks (actors/verifier.py)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from lever_actors.channels.messages import Beside
from lever_actors.policy.schedule import Places


@dataclass
class Place:
    """A request's place in the batch."""

    seat: int  # its number in the verifier's batch: in arrival order
    kv_tokens: int  # the KV it may fill: what it asked, or less where the room had less
    # cancelled, with `failure` set, when an actor of the crew it joined fails
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    failure: BaseException | None = None
    # the crew it joined (that crew's end: crew.py Crew), until the verifier let it go
    crew: trio.Event | None = None
    last: Beside = Beside()  # its last tree's nodes and the tokens they gave


@dataclass
class _Waiter:
    admitted: trio.Event = field(default_factory=trio.Event)
    place: Place | None = None


class Batch:
    """The places of the requests decoding at once, and the line of those waiting. Runs on
    the event loop's thread alone, so plain counts suffice."""

    def __init__(self, parallel: int, room_tokens: int) -> None:
        self.places: dict[int, Place] = {}
        self._scheduler = Places(parallel, room_tokens)
        self._line: dict[int, _Waiter] = {}  # by ticket
        self._tickets = itertools.count()
        self._changed = trio.Event()  # set, and replaced, when a request takes or leaves a place

    @property
    def parallel(self) -> int:
        """How many requests may hold places at once."""
        return self._scheduler.parallel

    @property
    def active(self) -> int:
        return len(self.places)

    @property
    def queued(self) -> int:
        return len(self._line)

    @property
    def kv_usage(self) -> float:
        """The share of the KV room the placed requests may fill (0 to 1)."""
        scheduler = self._scheduler
        return min(1.0, sum(scheduler.placed.values()) / scheduler.room_tokens)

    @property
    def free_tokens(self) -> int:
        """The KV room the placed requests leave: the prefix cache's, read on this thread
        and passed to its calls on the compute unit's."""
        return self._scheduler.free_tokens

    @asynccontextmanager
    async def place(self, kv_tokens: int, least_tokens: int | None = None) -> AsyncIterator[Place]:
        """Wait in line for a place for a request that may fill `kv_tokens` of KV, or start
        with as little as `least_tokens` where the room has no more; hold it for the
        block."""
        ticket, waiter = next(self._tickets), _Waiter()
        self._line[ticket] = waiter
        self._seat(self._scheduler.join(ticket, kv_tokens, least_tokens))
        try:
            await waiter.admitted.wait()
        except BaseException:
            if waiter.place is None:
                del self._line[ticket]
                self._seat(self._scheduler.withdraw(ticket))  # those behind it may fit now
            else:  # admitted as it was cancelled
                self._leave(waiter.place)
            raise
        assert waiter.place is not None  # set with `admitted`
        try:
            yield waiter.place
        finally:
            self._leave(waiter.place)

    async def occupied(self) -> None:
        """Return once a request holds a place."""
        while not self.places:
            await self._changed.wait()

    async def emptied(self) -> None:
        """Return once no request holds a place."""
        while self.places:
            await self._changed.wait()

    def beside(self, place: Place) -> Beside:
        """The other places' last trees: what a pass will verify beside this one's."""
        others = [p.last for seat, p in self.places.items() if seat != place.seat]
        return Beside(len(others), sum(b.rows for b in others), sum(b.tokens for b in others))

    def fail(self, error: BaseException, crew: trio.Event) -> None:
        """An actor of `crew` has failed: each request that joined it, and that its verifier
        has not let go of, ends with `error` (the first one's: its peers may fail next,
        seeing their channels close)."""
        for place in self.places.values():
            if place.crew is not crew:
                continue
            if place.failure is None:
                place.failure = error
            place.scope.cancel()

    def _seat(self, admitted: list[tuple[int, int]]) -> None:
        """The places the scheduler gave, taken by those waiting."""
        for ticket, seat in admitted:
            waiter = self._line.pop(ticket)
            waiter.place = Place(seat, self._scheduler.placed[seat])
            self.places[seat] = waiter.place
            waiter.admitted.set()
            self._changed.set()
            self._changed = trio.Event()

    def _leave(self, place: Place) -> None:
        del self.places[place.seat]
        self._changed.set()
        self._changed = trio.Event()
        self._seat(self._scheduler.leave(place.seat))
