"""The engine inside an asyncio program: `AsyncEngine`, with the trio API's shape.

    async with AsyncEngine.open(config) as engine:
        async for event in engine.stream("def fib(n):", max_new_tokens=64):
            print(event.text, end="")

Trio runs as a guest on the running asyncio loop (`trio.lowlevel.start_guest_run`): its tasks
run on the loop's own thread, between asyncio's callbacks, so events are handed over as
they are, never copied between threads. A stream is pulled: each event the asyncio consumer
asks for is one event the trio side takes from `Engine.stream`, so a slow consumer slows
production exactly as under trio. Cancelling the asyncio task, or leaving the loop early,
cancels the request at once; the engine then serves the next one. A request still running
when the block ends fails with `EngineClosedError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Unpack

import trio

from lever_actors.channels.messages import TokenEvent
from lever_actors.checkpoints.tokenizer import Message
from lever_actors.config import EngineConfig
from lever_actors.draft import DraftModel
from lever_actors.engine.engine import Engine
from lever_actors.engine.intake import Asked
from lever_actors.engine.results import GenerationResult
from lever_actors.errors import EngineClosedError
from lever_actors.options import GenerationKeywords, GenerationOptions, options_of
from lever_actors.progress import Progress

_END = object()  # the trio side's answer when a stream has no more events


class _Guest:
    """The asyncio side's handle on the trio guest run: a way in (its token, once it runs)
    and the cancel scope around everything it does."""

    def __init__(self) -> None:
        self.token: trio.lowlevel.TrioToken | None = None  # set when the run starts
        self.scope = trio.CancelScope()
        self.cancel_at_start = False

    def call(self, fn: Callable[..., object], *args: object) -> None:
        """Run `fn(*args)` inside trio, soon (it must not block); nothing once the run has
        ended, which ended every request with it."""
        assert self.token is not None, "the guest run has not started"
        try:
            self.token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    def cancel(self) -> None:
        """End the guest run, whether or not it has started."""
        if self.token is None:
            self.cancel_at_start = True
        else:
            self.call(self.scope.cancel)


class AsyncEngine:
    """An `Engine` served to asyncio. Use `AsyncEngine.open` from a running asyncio loop."""

    def __init__(self, engine: Engine, nursery: trio.Nursery, guest: _Guest) -> None:
        self.engine = engine  # its plain attributes (config, tokenizer, target) may be read
        self._nursery = nursery
        self._guest = guest
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._waiting: set[asyncio.Future] = set()  # answers the trio side owes

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        config: EngineConfig,
        *,
        draft: DraftModel | None = None,
        progress: Progress | None = None,
    ) -> AsyncIterator[AsyncEngine]:
        """`Engine.open` in a trio guest run on this asyncio loop, for the block's length."""
        loop = asyncio.get_running_loop()
        opened: asyncio.Future[AsyncEngine] = loop.create_future()
        finished: asyncio.Future[None] = loop.create_future()
        guest = _Guest()

        async def main() -> None:
            guest.token = trio.lowlevel.current_trio_token()
            if guest.cancel_at_start:
                guest.scope.cancel()
            with guest.scope:
                async with Engine.open(config, draft=draft, progress=progress) as engine:
                    async with trio.open_nursery() as nursery:
                        _resolve(opened, cls(engine, nursery, guest))
                        await trio.sleep_forever()  # until the block ends: guest.scope

        def done(outcome) -> None:
            """The guest run ended: its error goes to whoever waits, once."""
            try:
                outcome.unwrap()
            except BaseException as error:  # handed to the asyncio side, which raises it
                if opened.done():
                    _fail(finished, error)
                else:
                    _fail(opened, error)
                    _resolve(finished, None)
            else:
                _fail(opened, EngineClosedError("the engine closed while it was opening"))
                _resolve(finished, None)

        trio.lowlevel.start_guest_run(
            main,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=done,
            host_uses_signal_set_wakeup_fd=True,
        )
        try:
            engine = await asyncio.shield(opened)
        except asyncio.CancelledError:
            guest.cancel()
            await asyncio.shield(finished)
            raise
        try:
            yield engine
        finally:
            engine._closed = True
            guest.cancel()  # requests still running end with the block
            try:
                await asyncio.shield(finished)
            finally:
                engine._fail_waiting()

    async def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Message] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: GenerationOptions | None = None,
        **keywords: Unpack[GenerationKeywords],
    ) -> AsyncGenerator[TokenEvent, None]:
        """`Engine.stream` with the same arguments. Leaving the loop or cancelling the task
        cancels the request."""
        request = Asked(prompt, messages, tools, options_of(options, keywords), None)
        asks, scope = self._start(self._serve_stream, request)
        try:
            while True:
                event = await self._ask(asks)
                if event is _END:
                    return
                yield event
        finally:
            self._guest.call(scope.cancel)

    async def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Message] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: GenerationOptions | None = None,
        **keywords: Unpack[GenerationKeywords],
    ) -> GenerationResult:
        """`Engine.generate` with the same arguments."""
        request = Asked(prompt, messages, tools, options_of(options, keywords), None)
        asks, scope = self._start(self._serve_generate, request)
        try:
            return await self._ask(asks)
        finally:
            self._guest.call(scope.cancel)

    def _ask(self, asks: trio.MemorySendChannel[asyncio.Future]) -> asyncio.Future:
        """A future for the trio side to answer, sent to it: failed with EngineClosedError
        if the engine closes first."""
        if self._closed:
            raise _closed_mid_request()
        answer = self._loop.create_future()
        self._waiting.add(answer)
        answer.add_done_callback(self._waiting.discard)
        self._guest.call(asks.send_nowait, answer)
        return answer

    def _fail_waiting(self) -> None:
        """The block has ended and the trio run with it: nothing will answer these."""
        for answer in list(self._waiting):
            _fail(answer, _closed_mid_request())

    def _start(
        self,
        serve: Callable[..., Awaitable[None]],
        request: Asked,
    ) -> tuple[trio.MemorySendChannel[asyncio.Future], trio.CancelScope]:
        """A trio task running `serve(asks, request)` in a scope of its own; each future sent
        to `asks` is answered by it."""
        if self._closed:
            raise EngineClosedError("this engine was closed; open another")
        asks, receive = trio.open_memory_channel[asyncio.Future](1)
        scope = trio.CancelScope()

        async def task() -> None:
            with scope, receive:
                await serve(receive, request)

        self._guest.call(self._nursery.start_soon, task)
        return asks, scope

    async def _serve_stream(self, asks, request: Asked) -> None:
        events = self.engine.stream(
            request.prompt, messages=request.messages, tools=request.tools, options=request.options
        )
        try:
            async for answer in asks:
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    _resolve(answer, _END)
                    return
                except Exception as error:  # handed to the consumer, who raises it
                    _fail(answer, error)
                    return
                _resolve(answer, event)
        finally:
            await events.aclose()  # ends the request if the consumer left early

    async def _serve_generate(self, asks, request: Asked) -> None:
        answer = await asks.receive()
        try:
            result = await self.engine.generate(
                request.prompt,
                messages=request.messages,
                tools=request.tools,
                options=request.options,
            )
            _resolve(answer, result)
        except Exception as error:  # handed to the caller, who raises it
            _fail(answer, error)


def _closed_mid_request() -> EngineClosedError:
    return EngineClosedError("the engine closed before this request finished")


def _resolve(future: asyncio.Future, value: object) -> None:
    if not future.done():  # a consumer that was cancelled no longer waits for it
        future.set_result(value)


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
