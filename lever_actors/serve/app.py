"""The OpenAI-compatible routes over one open Engine, as a Starlette (ASGI) application.

The engine serves one request at a time; `Admission` lets `queue` more wait and answers
the rest 429 with Retry-After. A streamed response is server-sent events; a client that
disconnects mid-stream cancels its request (Starlette cancels the body's iteration, which
closes the engine's stream).
"""

from __future__ import annotations

import secrets
import weakref
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lever_actors.channels.messages import TokenEvent
from lever_actors.config import DEFAULT_MAX_NEW_TOKENS
from lever_actors.engine import Engine
from lever_actors.errors import ConfigError, ContextLengthError
from lever_actors.serve.schemas import (
    ChatRequest,
    CompletionRequest,
    Reply,
    Sampled,
    error_body,
    usage,
)

RETRY_AFTER_SECONDS = 5


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
    """Requests inside the server: one running, at most `queue` waiting. Runs on the event
    loop's single thread, so a plain count suffices."""

    def __init__(self, queue: int) -> None:
        self.limit = queue + 1
        self.inside = 0

    def enter(self) -> _Ticket:
        if self.inside >= self.limit:
            raise ApiError(
                429, "the server is busy: try again shortly", "rate_limit_exceeded", "busy"
            )
        self.inside += 1
        return _Ticket(self)


class _Ticket:
    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:  # once, however many paths end the request
            self._admission.inside -= 1
            self._admission = None


def build_app(
    engine: Engine,
    *,
    model_name: str,
    queue: int = 8,
    api_key: str | None = None,
    default_max_tokens: int = DEFAULT_MAX_NEW_TOKENS,
) -> Starlette:
    """The application serving `engine` under `model_name`."""
    routes = _Routes(engine, model_name, Admission(queue), api_key, default_max_tokens)
    return Starlette(
        routes=[
            Route("/health", routes.health, methods=["GET"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        ],
        exception_handlers={HTTPException: _http_error, ApiError: _api_error},
    )


class _Routes:
    def __init__(
        self,
        engine: Engine,
        model_name: str,
        admission: Admission,
        api_key: str | None,
        default_max_tokens: int,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.admission = admission
        self.api_key = api_key
        self.default_max_tokens = default_max_tokens

    async def health(self, request: Request) -> Response:
        n_ctx = self.engine.context.tokens
        return _JSON({"status": "ok", "requests": self.admission.inside, "n_ctx": n_ctx})

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "local"}
        return _JSON({"object": "list", "data": [model]})

    async def completions(self, request: Request) -> Response:
        parsed = await self._parse(request, CompletionRequest)
        return await self._answer(parsed, Reply(False, self.model_name), parsed.prompt)

    async def chat_completions(self, request: Request) -> Response:
        parsed = await self._parse(request, ChatRequest)
        return await self._answer(parsed, Reply(True, self.model_name), None, parsed.conversation())

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), self.api_key.encode()):
            raise ApiError(401, "incorrect API key", "invalid_request_error", "invalid_api_key")

    async def _parse(self, request: Request, schema: type[Sampled]) -> Any:
        self._authorize(request)
        body = await request.body()
        try:
            return msgspec.json.decode(body, type=schema)
        except msgspec.ValidationError as e:
            raise ApiError(400, str(e), "invalid_request_error") from None
        except msgspec.DecodeError as e:
            raise ApiError(
                400, f"the body is not valid JSON: {e}", "invalid_request_error"
            ) from None

    async def _answer(
        self,
        parsed: Sampled,
        reply: Reply,
        prompt: str | list[int] | None,
        messages: list[dict[str, str]] | None = None,
    ) -> Response:
        try:
            options = parsed.options(self.default_max_tokens)
        except ConfigError as e:
            raise ApiError(400, str(e), "invalid_request_error") from None
        ticket = self.admission.enter()
        if not parsed.stream:
            try:
                result = await self.engine.generate(prompt, messages=messages, options=options)
            except ConfigError as e:
                raise ApiError.bad_request(e) from None
            finally:
                ticket.release()
            use = usage(result.prompt_tokens, result.generated_tokens, result.cached_tokens)
            return _JSON(reply.whole(result.text, result.finish_reason, use))
        events = self.engine.stream(prompt, messages=messages, options=options)
        try:  # the first token before the headers: a bad request is still a 400
            first = await events.__anext__()
        except BaseException as e:
            ticket.release()
            await events.aclose()
            if isinstance(e, ConfigError):
                raise ApiError.bad_request(e) from None
            raise
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        body = _sse(reply, first, events, include_usage, ticket)
        weakref.finalize(body, ticket.release)  # also if the response never starts
        return StreamingResponse(body, media_type="text/event-stream")


async def _sse(
    reply: Reply,
    first: TokenEvent,
    events: AsyncGenerator[TokenEvent, None],
    include_usage: bool,
    ticket: _Ticket,
) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per token, the finish reason on the last, [DONE]."""
    try:
        if reply.chat:
            yield _event(reply.chunk(None, first=True))
        last = first
        yield _event(reply.chunk(first.text, first.finish_reason))
        async for event in events:
            last = event
            yield _event(reply.chunk(event.text, event.finish_reason))
        if include_usage:
            use = usage(last.prompt_tokens, last.generated_tokens, last.cached_tokens)
            yield _event(reply.usage_chunk(use))
        yield b"data: [DONE]\n\n"
    finally:
        ticket.release()
        await events.aclose()  # a client gone mid-stream cancels the request here


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)  # the handler of HTTPException (build_app)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _JSON(error_body(exc.detail, kind), status_code=exc.status_code)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)  # the handler of ApiError (build_app)
    return exc.response()
