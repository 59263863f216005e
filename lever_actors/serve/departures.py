"""A client that leaves before its answer is ready cancels the work done for it: a whole
(non-streamed) request's generation, or a streamed one's prefill before the first token.
Once a stream has started, a departure shows as a failed send (Starlette ends the body).

A keep-alive connection may pipeline requests: hypercorn reads none of the connection while
one is answered, so a client that closes is not seen to, and its pipelined requests would
each run in turn for nobody, holding places. `GoneConnections` remembers a connection whose
client left, and answers the requests still queued on it without running them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lever_actors.serve.errors import JSON
from lever_actors.serve.schemas import error_body

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


# how long a connection whose client left is remembered after its last request: its
# pipelined requests come one after the other, each answered at once
REMEMBER_SECONDS = 2.0
# how long the end of a response looks for a departure already reported: hypercorn reports
# a failed write at once, and a whole response's own end only after its last body
REPORTED_SECONDS = 0.001


class GoneConnections:
    """ASGI middleware: a request on a connection whose client has left is answered 499 at
    once, without running. A connection is known gone when a request on it sees the
    client's departure before its response ended (hypercorn reports a failed write so)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._gone: dict[tuple[object, object], float] = {}  # (client, server) -> forget at

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        connection = (scope.get("client"), scope.get("server"))
        now = trio.current_time()
        if self._gone.get(connection, now) > now:
            self._gone[connection] = now + REMEMBER_SECONDS
            body = error_body("the client has closed its connection", "invalid_request_error")
            await JSON(body, status_code=499)(scope, receive, send)
            return
        left = ended = False

        async def receiving() -> Message:
            nonlocal left
            message = await receive()
            left = left or (message["type"] == "http.disconnect" and not ended)
            return message

        async def sending(message: Message) -> None:
            nonlocal left, ended
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                if not left:  # nobody may be listening: look once
                    with trio.move_on_after(REPORTED_SECONDS):
                        left = (await receive())["type"] == "http.disconnect"
                ended = True
            await send(message)

        await self.app(scope, receiving, sending)
        if left:
            self._remember(connection, trio.current_time())

    def _remember(self, connection: tuple[object, object], now: float) -> None:
        self._gone = {c: until for c, until in self._gone.items() if until > now}
        self._gone[connection] = now + REMEMBER_SECONDS
