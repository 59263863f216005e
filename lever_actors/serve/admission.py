"""Who is inside the server: the engine decodes up to `parallel` requests at once
(EngineConfig.parallel); `Admission` lets `queue` more wait and answers the rest 429 with
Retry-After. `Admission.drain` shuts the doors: new requests get 503, and those inside are
cut after a grace period (`Cut`), a stream with a last chunk. /health reports its figures."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from typing import TypeVar

import trio

from lever_actors.engine.batch import Batch
from lever_actors.logs import get_logger
from lever_actors.serve.errors import ApiError

log = get_logger(__name__)

T = TypeVar("T")

DRAIN_POLL_SECONDS = 0.05  # how often a drain looks whether the last request has left


class Admission:
    """Requests inside the server: of those the engine has or waits for (`working`), up to
    `parallel` running and at most `queue` waiting; none once it drains, which waits for
    every response to end (`inside`: a stream may still be sending what the engine finished).
    Runs on the event loop's single thread, so plain counts suffice."""

    def __init__(self, queue: int, batch: Batch) -> None:
        self.batch = batch  # the engine's: its places decide which of `working` run
        self.limit = queue + batch.parallel
        self.inside = 0
        self.working = 0
        self.draining = False
        self._cut = False
        self._scopes: set[trio.CancelScope] = set()

    def figures(self) -> dict[str, int]:
        """/health's: requests inside, decoding, waiting for a place in the batch, and how
        many may decode at once."""
        return {
            "requests": self.inside,
            "active": self.batch.active,  # decoding
            "queued": self.batch.queued,  # waiting for a place in the batch
            "parallel": self.batch.parallel,
        }

    def enter(self) -> Ticket:
        if self.draining:
            raise ApiError(503, "the server is shutting down", "server_error", "shutting_down")
        if self.working >= self.limit:
            raise ApiError(
                429, "the server is busy: try again shortly", "rate_limit_exceeded", "busy"
            )
        self.inside += 1
        self.working += 1
        return Ticket(self)

    @contextmanager
    def cuttable(self) -> Iterator[trio.CancelScope]:
        """A scope that the end of a drain cancels (at once, if it has ended)."""
        scope = trio.CancelScope()
        if self._cut:
            scope.cancel()
        self._scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._scopes.discard(scope)

    async def until_cut(self, events: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
        """`events` until they end, or until a drain cuts them (then `Cut`)."""
        try:
            while True:
                with self.cuttable() as scope:  # around each wait: never around a yield
                    event = await anext(events, None)
                if scope.cancelled_caught:
                    raise Cut
                if event is None:
                    return
                yield event
        finally:
            await events.aclose()

    async def drain(self, grace: float) -> None:
        """Refuse new requests (503), let those inside finish for `grace` seconds, then cut
        the rest, and return once all have left."""
        self.draining = True
        log.info("draining", requests=self.inside, grace_seconds=grace)
        with trio.move_on_after(grace):
            await self._emptied()
        self._cut = True
        for scope in list(self._scopes):
            scope.cancel()
        await self._emptied()

    async def _emptied(self) -> None:
        # polled: a ticket may be released by a finalizer, outside any trio task
        while self.inside:
            await trio.sleep(DRAIN_POLL_SECONDS)


class Cut(Exception):
    """A drain ended this request before the engine did."""


class Ticket:
    """One request's admission: its place in the queue until the engine has done with it,
    its place inside until its response has ended."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission
        self._working = True

    def engine_done(self) -> None:
        """The engine has done with the request: its place in the queue is free."""
        if self._admission is not None and self._working:
            self._admission.working -= 1
            self._working = False

    def release(self) -> None:
        """The response has ended (the engine's part too, if it had not)."""
        if self._admission is not None:  # once, however many paths end the request
            self.engine_done()
            self._admission.inside -= 1
            self._admission = None
