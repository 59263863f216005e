"""A client that leaves before its answer is ready cancels the work done for it: a whole
(non-streamed) request's generation, or a streamed one's prefill before the first token.
Once a stream has started, a departure shows as a failed send (Starlette ends the body)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio
from starlette.requests import Request

T = TypeVar("T")


class ClientLeft(Exception):
    """The client disconnected while its answer was being made; the work was cancelled."""


async def unless_gone(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """await work(), cancelled at once if the client disconnects first (ClientLeft then)."""
    with trio.CancelScope() as gone:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch, request, gone)
                value = await work()
                nursery.cancel_scope.cancel()  # the watcher: its client stayed
                return value
        except BaseExceptionGroup as group:  # the work's own error, out of the nursery's group
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
    raise ClientLeft


async def _watch(request: Request, gone: trio.CancelScope) -> None:
    """Cancel `gone` when the client's connection ends (the body has been read: what comes
    next from it is its departure)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.cancel()
