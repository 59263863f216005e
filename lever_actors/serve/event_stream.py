"""Server-sent events as an ASGI response that ends its connection where HTTP says so.

Starlette's StreamingResponse sends its last message (`more_body: False`) from a task that
a listener for the client's departure cancels. On HTTP/1.0, or with `Connection: close`,
that last message makes hypercorn close the socket from inside the send, and the client's
own end, arriving meanwhile, cancelled the close half-done: the socket stayed open and an
HTTP/1.0 client, whose stream ends only at the close, waited for ever (#64, E7). Here the
last message is sent after the listener has ended, where nothing cancels it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import trio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class EventStream(StreamingResponse):
    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = False
        try:
            async with trio.open_nursery() as nursery:

                async def listen() -> None:
                    """A client that leaves ends the stream (and so its request)."""
                    nonlocal gone
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    gone = True
                    nursery.cancel_scope.cancel()

                nursery.start_soon(listen)
                start = {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                await send(start)
                async for part in self.events:
                    await send({"type": "http.response.body", "body": part, "more_body": True})
                nursery.cancel_scope.cancel()  # the listener: the stream has ended
        finally:
            await self.events.aclose()  # a client gone mid-stream cancels the request here
        if not gone:  # outside the listener's scope: a close it brings about runs whole
            await send({"type": "http.response.body", "body": b"", "more_body": False})
