"""The OpenAI-compatible routes over one open Engine, as a Starlette (ASGI) application.

The engine decodes up to `parallel` requests at once (EngineConfig.parallel); `Admission`
lets `queue` more wait and answers the rest 429 with Retry-After. A streamed response is
server-sent events; a client that disconnects mid-stream cancels its request (Starlette
cancels the body's iteration, which closes the engine's stream). `Admission.drain` shuts
the doors: new requests get 503, and those inside are cut after a grace period, a stream
with a last chunk.

Bodies must be sent as application/json (415 otherwise): a web page can post text/plain
or a form to a local server without asking, but not JSON. Where `allowed_hosts` is given,
a request naming another Host gets 421, so that a page whose name was rebound to 127.0.0.1
cannot read the answers.
"""

from __future__ import annotations

import secrets
import weakref
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Collection,
    Iterator,
    Sequence,
)
from contextlib import contextmanager
from functools import partial
from typing import Any

import msgspec
import trio
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from lever_actors.channels.messages import FinishReason, TokenEvent, TopLogprob
from lever_actors.engine import Engine
from lever_actors.errors import (
    ConfigError,
    ConsumerStalledError,
    ContextLengthError,
    DeadlineError,
)
from lever_actors.logs import get_logger
from lever_actors.serve.departures import ClientLeft, unless_gone
from lever_actors.serve.options import ServeOptions
from lever_actors.serve.schemas import (
    ChatRequest,
    CompletionRequest,
    Reply,
    Sampled,
    TokenLogprob,
    error_body,
    usage,
)
from lever_actors.text.tool_calls import OPEN, CallText, read_calls

log = get_logger(__name__)

# a token, its text, its log-probability, its alternatives -> what the response says of it
Describer = Callable[[int, str, float, Sequence[TopLogprob]], list[TokenLogprob]]

RETRY_AFTER_SECONDS = 5
CUT_REASON: FinishReason = "length"  # a stream the shutdown cut: its text ends short
DRAIN_POLL_SECONDS = 0.05  # how often a drain looks whether the last request has left


class _JSON(JSONResponse):
    """JSON by msgspec, which also encodes structs (Usage)."""

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


class ApiError(Exception):
    """Answered as an OpenAI-style error body with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        code: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code
        self.details = details or {}  # more fields of the error object

    @classmethod
    def bad_request(cls, error: ConfigError) -> ApiError:
        """A 400 for a request the engine refused; one too long for the context says so
        as llama-server does, with its prompt's and the context's sizes."""
        if isinstance(error, ContextLengthError):
            details = {"n_prompt_tokens": error.prompt_tokens, "n_ctx": error.context_tokens}
            return cls(400, str(error), "invalid_request_error", "context_length_exceeded", details)
        return cls(400, str(error), "invalid_request_error")

    def response(self) -> Response:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if self.status == 429 else None
        body = error_body(self.message, self.kind, self.code)
        body["error"] |= self.details
        return _JSON(body, status_code=self.status, headers=headers)


class Admission:
    """Requests inside the server: of those the engine has or waits for (`working`), up to
    `parallel` running and at most `queue` waiting; none once it drains, which waits for
    every response to end (`inside`: a stream may still be sending what the engine finished).
    Runs on the event loop's single thread, so plain counts suffice."""

    def __init__(self, queue: int, parallel: int = 1) -> None:
        self.limit = queue + parallel
        self.inside = 0
        self.working = 0
        self.draining = False
        self._cut = False
        self._scopes: set[trio.CancelScope] = set()

    def enter(self) -> _Ticket:
        if self.draining:
            raise ApiError(503, "the server is shutting down", "server_error", "shutting_down")
        if self.working >= self.limit:
            raise ApiError(
                429, "the server is busy: try again shortly", "rate_limit_exceeded", "busy"
            )
        self.inside += 1
        self.working += 1
        return _Ticket(self)

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

    async def until_cut(
        self, events: AsyncGenerator[TokenEvent, None]
    ) -> AsyncGenerator[TokenEvent, None]:
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


class _Ticket:
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


def build_app(engine: Engine, options: ServeOptions) -> Starlette:
    """The application serving `engine` as `options` say; its `state.admission` drains it."""
    admission = Admission(options.queue, engine.batch.parallel)
    routes = _Routes(engine, options, admission)
    allowed = options.allowed_hosts
    hosts = [] if allowed is None else [Middleware(_AllowedHosts, names=allowed)]
    app = Starlette(
        routes=[
            Route("/health", routes.health, methods=["GET"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        ],
        middleware=hosts,
        exception_handlers={
            HTTPException: _http_error,
            ApiError: _api_error,
            ClientDisconnect: _client_gone,
            ClientLeft: _client_left,
            Exception: _server_error,
        },
    )
    app.state.admission = admission
    return app


class _AllowedHosts:
    """Answers 421 to a request whose Host header names none of `names` (any port)."""

    def __init__(self, app: ASGIApp, names: Collection[str]) -> None:
        self.app = app
        self.names = {name.lower() for name in names}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = Headers(scope=scope).get("host", "") if scope["type"] == "http" else None
        if given is not None and host_name(given) not in self.names:
            message = f"Host {given!r} is not one this server answers to"
            body = error_body(message, "invalid_request_error", "host_not_allowed")
            await _JSON(body, status_code=421)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def host_name(header: str) -> str:
    """A Host header's name without its port: 'localhost:8000' -> 'localhost',
    '[::1]:8000' -> '::1'."""
    if header.startswith("["):
        return header[1:].partition("]")[0].lower()
    return header.partition(":")[0].lower()


class _Routes:
    def __init__(self, engine: Engine, options: ServeOptions, admission: Admission) -> None:
        self.engine = engine
        self.options = options
        self.admission = admission
        tokenizer = engine.tokenizer  # whether a tool call's markers are tokens of their own
        self.marker_tokens = tokenizer is not None and tokenizer.has_token(OPEN)

    async def health(self, request: Request) -> Response:
        batch = self.engine.batch
        return _JSON(
            {
                "status": "ok",
                "requests": self.admission.inside,
                "active": batch.active,  # decoding
                "queued": batch.queued,  # waiting for a place in the batch
                "parallel": batch.parallel,
                "n_ctx": self.engine.context.tokens,
            }
        )

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        model = {
            "id": self.options.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "local",
        }
        return _JSON({"object": "list", "data": [model]})

    async def completions(self, request: Request) -> Response:
        parsed = await self._parse(request, CompletionRequest)
        return await self._answer(
            request, parsed, Reply(False, self.options.model_name), parsed.prompt
        )

    async def chat_completions(self, request: Request) -> Response:
        parsed = await self._parse(request, ChatRequest)
        reply = Reply(True, self.options.model_name)
        conversation, tools = parsed.conversation(), parsed.functions()
        return await self._answer(request, parsed, reply, None, conversation, tools)

    def _describer(self) -> Describer:
        """token, its text, logprob, top -> its TokenLogprob, none for an end token (whose
        text is never emitted)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ConfigError("log-probabilities need the model's tokenizer, which it lacks")

        def described(token: int, piece: str, logprob: float, top: Sequence[TopLogprob]):
            if token in tokenizer.eos_ids:
                return []
            return [TokenLogprob(piece, logprob, tuple((t.text, t.logprob) for t in top))]

        return described

    def _authorize(self, request: Request) -> None:
        key = self.options.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "incorrect API key", "invalid_request_error", "invalid_api_key")

    async def _parse(self, request: Request, schema: type[Sampled]) -> Any:
        self._authorize(request)
        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/json":
            raise ApiError(
                415,
                f"send the body as Content-Type: application/json, not {media or 'none'}",
                "invalid_request_error",
                "unsupported_media_type",
            )
        body = await self._body(request)
        try:
            return msgspec.json.decode(body, type=schema)
        except msgspec.ValidationError as e:
            raise ApiError(400, str(e), "invalid_request_error") from None
        except msgspec.DecodeError as e:
            raise ApiError(
                400, f"the body is not valid JSON: {e}", "invalid_request_error"
            ) from None

    async def _body(self, request: Request) -> bytes:
        """The body, refused (413) past max_body: by its Content-Length, or as it comes."""
        too_large = ApiError(
            413,
            f"the body exceeds the server's limit of {self.options.max_body} bytes",
            "invalid_request_error",
            "request_too_large",
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.options.max_body:
            raise too_large
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.options.max_body:
                raise too_large
            parts.append(part)
        return b"".join(parts)

    async def _answer(
        self,
        request: Request,
        parsed: Sampled,
        reply: Reply,
        prompt: str | list[int] | None,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> Response:
        """The engine's answer, whole or streamed; with `tools`, tool calls read out of it."""
        try:
            options = parsed.options(
                self.options.default_max_tokens, self.options.deadline_seconds, self.marker_tokens
            )
            described = self._describer() if parsed.top_logprobs_asked() is not None else None
        except ConfigError as e:
            raise ApiError(400, str(e), "invalid_request_error") from None
        ticket = self.admission.enter()
        if not parsed.stream:
            whole = partial(
                self.engine.generate, prompt, messages=messages, tools=tools, options=options
            )
            try:
                with self.admission.cuttable() as scope:
                    result = await unless_gone(request, whole)
            except ConfigError as e:
                raise ApiError.bad_request(e) from None
            except DeadlineError as e:
                raise _timed_out(e) from None
            finally:
                ticket.release()
            if scope.cancelled_caught:
                raise _shut_down()
            use = usage(result.prompt_tokens, result.generated_tokens, result.cached_tokens)
            logprobs = None
            if described is not None:
                each = zip(
                    result.tokens, result.pieces, result.logprobs, result.top_logprobs, strict=True
                )
                logprobs = [t for args in each for t in described(*args)]
            text, calls = read_calls(result.text) if tools else (result.text, [])
            return _JSON(reply.whole(text, result.finish_reason, use, logprobs, calls))
        # the place in the queue is free once the engine's work is: a stalled reader whose
        # request the engine ended holds none, though its response (which a drain awaits)
        # waits on it still
        stream = self.engine.stream(
            prompt, messages=messages, tools=tools, options=options, on_done=ticket.engine_done
        )
        events = self.admission.until_cut(stream)
        try:  # the first token before the headers: a bad request is still a 400
            first = await unless_gone(request, events.__anext__)
        except BaseException as e:
            ticket.release()
            await events.aclose()
            if isinstance(e, ConfigError):
                raise ApiError.bad_request(e) from None
            if isinstance(e, Cut):
                raise _shut_down() from None
            if isinstance(e, DeadlineError):
                raise _timed_out(e) from None
            raise
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        held = CallText() if tools else None
        body = _sse(reply, first, events, include_usage, ticket, described, held)
        weakref.finalize(body, ticket.release)  # also if the response never starts
        return StreamingResponse(body, media_type="text/event-stream")


async def _sse(
    reply: Reply,
    first: TokenEvent,
    events: AsyncGenerator[TokenEvent, None],
    include_usage: bool,
    ticket: _Ticket,
    described: Describer | None = None,
    calls: CallText | None = None,
) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per token, the finish reason on the last (CUT_REASON on
    a chunk of its own where a drain cut the stream), [DONE]; each token's log-probability
    where `described`; tool calls, where `calls` holds them back, in a last chunk."""
    offset = 0  # characters of the tokens' texts so far, for the legacy text_offset

    def chunks(event: TokenEvent) -> Iterator[bytes]:
        nonlocal offset
        logprobs = None
        if described is not None:
            tokens = described(event.token, event.piece, event.logprob, event.top_logprobs)
            logprobs = reply.logprobs(tokens, offset)
            offset += sum(len(t.text) for t in tokens)
        if calls is None:
            yield _event(reply.chunk(event.text, event.finish_reason, logprobs=logprobs))
            return
        text = calls.push(event.text)
        if event.finish_reason is None:
            yield _event(reply.chunk(text, logprobs=logprobs))
            return
        rest, called = calls.end()
        yield _event(
            reply.chunk(text + rest, None if called else event.finish_reason, logprobs=logprobs)
        )
        if called:
            yield _event(reply.chunk(None, "tool_calls", calls=called))

    try:
        if reply.chat:
            yield _event(reply.chunk(None, first=True))
        last = first
        for part in chunks(first):
            yield part
        try:
            async for event in events:
                last = event
                for part in chunks(event):
                    yield part
        except Cut:
            yield _event(reply.chunk(None, CUT_REASON))
        except ConsumerStalledError as stalled:  # a reader that came back too late
            log.info("a stalled reader's request was ended", reason=str(stalled))
            return
        if include_usage:
            use = usage(last.prompt_tokens, last.generated_tokens, last.cached_tokens)
            yield _event(reply.usage_chunk(use))
        yield b"data: [DONE]\n\n"
    finally:
        ticket.release()
        await events.aclose()  # a client gone mid-stream cancels the request here


def _shut_down() -> ApiError:
    return ApiError(503, "the server shut down first", "server_error", "shutting_down")


def _timed_out(error: DeadlineError) -> ApiError:
    return ApiError(504, str(error), "server_error", "deadline_exceeded")


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)  # the handler of HTTPException (build_app)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _JSON(error_body(exc.detail, kind), status_code=exc.status_code)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)  # the handler of ApiError (build_app)
    return exc.response()


async def _client_gone(request: Request, exc: Exception) -> Response:
    """A client that left while sending its body: one line in the log, not a traceback."""
    log.info("a client left during its request's body", path=request.url.path)
    return Response(status_code=400)  # written to no one


async def _client_left(request: Request, exc: Exception) -> Response:
    """A client that left before its answer: its request was cancelled; one line."""
    log.info("a client left before its answer; its request was cancelled", path=request.url.path)
    return Response(status_code=499)  # written to no one


async def _server_error(request: Request, exc: Exception) -> Response:
    """A bug: still OpenAI's error body (the server logs the traceback)."""
    return _JSON(error_body("the server failed; see its log", "server_error"), status_code=500)
