"""The OpenAI-compatible routes over one open Engine, as a Starlette (ASGI) application.

Who may come in, wait or is cut by a drain is admission.py's. A streamed response is
server-sent events (event_stream.py); a client that disconnects mid-stream cancels its
request (the response stops iterating the body, which closes the engine's stream).

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
    Callable,
    Collection,
    Iterator,
    Sequence,
)
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec
import trio
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from lever_actors.channels.messages import TokenEvent, TopLogprob
from lever_actors.engine import Engine, GenerationResult
from lever_actors.errors import ConfigError, ConsumerStalledError, DeadlineError
from lever_actors.logs import get_logger
from lever_actors.options import GenerationOptions
from lever_actors.serve.admission import Admission, Cut, Ticket
from lever_actors.serve.departures import ClientLeft, GoneConnections, unless_gone
from lever_actors.serve.errors import JSON, ApiError, failure_message
from lever_actors.serve.event_stream import EventStream
from lever_actors.serve.metrics import CONTENT_TYPE as METRICS_TYPE
from lever_actors.serve.metrics import Finished, ServerMetrics
from lever_actors.serve.options import ServeOptions
from lever_actors.serve.responses import Conversations, ResponsesRequest, ResponseWriter
from lever_actors.serve.schemas import (
    Answer,
    ChatRequest,
    CompletionRequest,
    Reply,
    Sampled,
    TokenLogprob,
    error_body,
    usage,
)
from lever_actors.text.finish import CUT_SHORT, reply_finish
from lever_actors.text.tool_calls import OPEN, CallText, read_calls

log = get_logger(__name__)

# a token, its text, its log-probability, its alternatives -> what the response says of it
Describer = Callable[[int, str, float, Sequence[TopLogprob]], list[TokenLogprob]]


def build_app(engine: Engine, options: ServeOptions) -> Starlette:
    """The application serving `engine` as `options` say; its `state.admission` drains it."""
    admission = Admission(options.queue, engine.batch)
    routes = _Routes(engine, options, admission, ServerMetrics(engine))
    allowed = options.allowed_hosts
    hosts = [] if allowed is None else [Middleware(_AllowedHosts, names=allowed)]
    gone = [Middleware(GoneConnections)]
    app = Starlette(
        routes=[
            Route("/health", routes.health, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/responses", routes.responses, methods=["POST"]),
        ],
        middleware=gone + hosts,
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
        self.names = set(names)  # bare and lower case (ServeOptions)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = Headers(scope=scope).get("host", "") if scope["type"] == "http" else None
        if given is not None and host_name(given) not in self.names:
            message = f"Host {given!r} is not one this server answers to"
            body = error_body(message, "invalid_request_error", "host_not_allowed")
            await JSON(body, status_code=421)(scope, receive, send)
            return
        await self.app(scope, receive, send)


@contextmanager
def client_errors() -> Iterator[None]:
    """What a client sent that the library refuses (ConfigError), or that nests deeper than
    Python walks (a schema or a tool's parameters a thousand levels deep), is a 400 in
    OpenAI's body, not a server error."""
    try:
        yield
    except ConfigError as e:
        raise ApiError.bad_request(e) from None
    except RecursionError:
        raise ApiError(
            400, "the request nests JSON deeper than the server reads", "invalid_request_error"
        ) from None


def host_name(header: str) -> str:
    """A Host header's name without its port: 'localhost:8000' -> 'localhost',
    '[::1]:8000' -> '::1'."""
    if header.startswith("["):
        return header[1:].partition("]")[0].lower()
    return header.partition(":")[0].lower()


class _Routes:
    def __init__(
        self, engine: Engine, options: ServeOptions, admission: Admission, metrics: ServerMetrics
    ) -> None:
        self.engine = engine
        self.options = options
        self.admission = admission
        self.figures = metrics
        self.conversations = Conversations()  # for the Responses API's previous_response_id
        tokenizer = engine.tokenizer  # whether a tool call's markers are tokens of their own
        self.marker_tokens = tokenizer is not None and tokenizer.has_token(OPEN)

    async def health(self, request: Request) -> Response:
        figures = self.admission.figures()
        return JSON({"status": "ok", **figures, "n_ctx": self.engine.context.tokens})

    async def metrics(self, request: Request) -> Response:
        return Response(self.figures.text(), media_type=METRICS_TYPE)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        model = {
            "id": self.options.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "local",
        }
        return JSON({"object": "list", "data": [model]})

    async def completions(self, request: Request) -> Response:
        parsed = await self._parse(request, CompletionRequest)
        return await self._answer(
            request, parsed, Reply(False, self.options.model_name), parsed.prompt
        )

    async def responses(self, request: Request) -> Response:
        asked = await self._parse(request, ResponsesRequest)
        with client_errors():  # a past call's arguments that are not JSON, a bad item
            chat = asked.as_chat(self.conversations.before(asked.previous_response_id))
            conversation, tools = chat.conversation(), chat.functions()
        writer = ResponseWriter(asked, chat, self.options.model_name, self.conversations)
        return await self._answer(request, chat, writer, None, conversation, tools)

    async def chat_completions(self, request: Request) -> Response:
        parsed = await self._parse(request, ChatRequest)
        reply = Reply(True, self.options.model_name)
        with client_errors():  # a past tool call's arguments that are not JSON, say
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

    async def _parse(self, request: Request, schema: type[Sampled | ResponsesRequest]) -> Any:
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
            with client_errors():
                return msgspec.json.decode(body, type=schema)
        except msgspec.ValidationError as e:
            raise ApiError(400, str(e), "invalid_request_error") from None
        except msgspec.DecodeError as e:
            raise ApiError(
                400, f"the body is not valid JSON: {e}", "invalid_request_error"
            ) from None

    async def _choices(
        self,
        prompt: str | list[int] | None,
        messages: list[dict[str, Any]] | None,
        tools: list[dict[str, Any]] | None,
        options: GenerationOptions,
        n: int,
    ) -> list[GenerationResult]:
        """The request's `n` choices, each a request of the batch, decoded together."""
        chosen: dict[int, GenerationResult] = {}

        async def choose(index: int) -> None:
            choice = options.choice(index)
            chosen[index] = await self.engine.generate(
                prompt, messages=messages, tools=tools, options=choice
            )

        try:
            async with trio.open_nursery() as nursery:
                for index in range(n):
                    nursery.start_soon(choose, index)
        except BaseExceptionGroup as group:  # a choice's failure is the request's
            raise group.exceptions[0] from None
        return [chosen[index] for index in range(n)]

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
        reply: Reply | ResponseWriter,
        prompt: str | list[int] | None,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> Response:
        """The engine's answer, whole or streamed; with `tools`, tool calls read out of it."""
        ticket = self.admission.enter()  # a grammar's compile counts as its request's work
        try:
            with client_errors():
                options = await trio.to_thread.run_sync(  # a grammar compiles: off the loop
                    parsed.options,
                    self.options.default_max_tokens,
                    self.options.deadline_seconds,
                    self.marker_tokens,
                )
                described = self._describer() if parsed.top_logprobs_asked() is not None else None
        except BaseException:
            ticket.release()
            raise
        if not parsed.stream:
            whole = partial(self._choices, prompt, messages, tools, options, parsed.n)
            try:
                with self.admission.cuttable() as scope:
                    results = await unless_gone(request, whole)
            except ConfigError as e:
                raise ApiError.bad_request(e) from None
            except DeadlineError as e:
                raise _timed_out(e) from None
            finally:
                ticket.release()
            if scope.cancelled_caught:
                raise _shut_down()
            for result in results:
                self.figures.finished(Finished.of_result(result))
            prompted = results[0]  # the prompt, counted once
            generated = sum(result.generated_tokens for result in results)
            use = usage(prompted.prompt_tokens, generated, prompted.cached_tokens)
            answers = [_answer_of(result, described, bool(tools)) for result in results]
            return JSON(reply.whole(answers, use))
        # the place in the queue is free once the engine's work is: a stalled reader whose
        # request the engine ended holds none, though its response (which a drain awaits)
        # waits on it still
        stream = self.engine.stream_choices(
            parsed.n,
            prompt,
            messages=messages,
            tools=tools,
            options=options,
            on_done=ticket.engine_done,
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
        if isinstance(reply, ResponseWriter):
            body = reply.events(first[1], events, tools is not None, self.figures, ticket)
        else:
            include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            shown = (described, bool(tools))
            body = _sse(reply, first, events, include_usage, ticket, self.figures, *shown)
        weakref.finalize(body, ticket.release)  # also if the response never starts
        return EventStream(body)


@dataclass
class _Streamed:
    """One choice of a streamed response, as far as it has gone."""

    first: TokenEvent
    last: TokenEvent
    calls: CallText | None  # its tool calls held back, where the request has tools
    offset: int = 0  # characters of its tokens' texts so far, for the legacy text_offset


async def _sse(
    reply: Reply,
    first: tuple[int, TokenEvent],
    events: AsyncGenerator[tuple[int, TokenEvent], None],
    include_usage: bool,
    ticket: Ticket,
    metrics: ServerMetrics,
    described: Describer | None = None,
    with_tools: bool = False,
) -> AsyncGenerator[bytes, None]:
    """Server-sent events: one chunk per token of each choice (by its index), the finish
    reason on a choice's last (CUT_SHORT on a chunk of its own where a drain cut the
    stream), [DONE]; each token's log-probability where `described`; tool calls, held back
    where the request has tools, in a choice's last chunk."""
    choices: dict[int, _Streamed] = {}

    def chunks(index: int, event: TokenEvent) -> Iterator[bytes]:
        choice = choices.get(index)
        if choice is None:
            choice = choices[index] = _Streamed(event, event, CallText() if with_tools else None)
            if reply.chat:
                yield _event(reply.chunk(None, first=True, index=index))
        choice.last = event
        logprobs = None
        if described is not None:
            tokens = described(event.token, event.piece, event.logprob, event.top_logprobs)
            logprobs = reply.logprobs(tokens, choice.offset)
            choice.offset += sum(len(t.text) for t in tokens)
        calls = choice.calls
        if calls is None:
            yield _event(
                reply.chunk(event.text, event.finish_reason, logprobs=logprobs, index=index)
            )
            return
        text = calls.push(event.text)
        if event.finish_reason is None:
            yield _event(reply.chunk(text, logprobs=logprobs, index=index))
            return
        rest, called = calls.end()
        ended = reply_finish(event.finish_reason, bool(called))  # on the calls' chunk, if any
        yield _event(
            reply.chunk(text + rest, None if called else ended, logprobs=logprobs, index=index)
        )
        if called:
            yield _event(reply.chunk(None, ended, calls=called, index=index))

    try:
        for part in chunks(*first):
            yield part
        try:
            async for index, event in events:
                for part in chunks(index, event):
                    yield part
        except Cut:
            for index in choices:
                yield _event(reply.chunk(None, CUT_SHORT, index=index))
        except ConsumerStalledError as stalled:  # a reader that came back too late
            log.info("a stalled reader's request was ended", reason=str(stalled))
            return
        except Exception as error:  # the headers went out: the stream says so, then ends
            log.exception("a streamed request failed")
            yield _event(error_body(failure_message(error), "server_error"))
            yield b"data: [DONE]\n\n"
            return
        for choice in choices.values():
            metrics.finished(Finished.of_events(choice.first, choice.last))
        if include_usage:
            last = first[1] if not choices else next(iter(choices.values())).last
            generated = sum(choice.last.generated_tokens for choice in choices.values())
            use = usage(last.prompt_tokens, generated, last.cached_tokens)
            yield _event(reply.usage_chunk(use))
        yield b"data: [DONE]\n\n"
    finally:
        ticket.release()
        await events.aclose()  # a client gone mid-stream cancels the request here


def _answer_of(result: GenerationResult, described: Describer | None, tools: bool) -> Answer:
    """A whole response's choice: its text (tool calls read out of it where `tools`), and
    each token's log-probability where `described`."""
    logprobs = None
    if described is not None:
        each = zip(result.tokens, result.pieces, result.logprobs, result.top_logprobs, strict=True)
        logprobs = [t for args in each for t in described(*args)]
    text, calls = read_calls(result.text) if tools else (result.text, [])
    return Answer(text, result.finish_reason, logprobs, calls)


def _shut_down() -> ApiError:
    return ApiError(503, "the server shut down first", "server_error", "shutting_down")


def _timed_out(error: DeadlineError) -> ApiError:
    return ApiError(504, str(error), "server_error", "deadline_exceeded")


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)  # the handler of HTTPException (build_app)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSON(error_body(exc.detail, kind), status_code=exc.status_code)


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
    """A failure: still OpenAI's error body (the server logs the traceback)."""
    return JSON(error_body(failure_message(exc), "server_error"), status_code=500)
