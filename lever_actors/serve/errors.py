"""What the server answers when it does not answer a request: OpenAI's error body with an
HTTP status (`ApiError`), as JSON by msgspec."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import JSONResponse, Response

from lever_actors.errors import ConfigError, ContextLengthError, LeverError
from lever_actors.serve.schemas import error_body

RETRY_AFTER_SECONDS = 5


class JSON(JSONResponse):
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
        return JSON(body, status_code=self.status, headers=headers)


def failure_message(error: Exception) -> str:
    """What a client is told of a failure: the library's own (a damaged layout, say) by its
    one-line message, anything else as a bug whose traceback is in the log."""
    if isinstance(error, LeverError):
        return str(error)
    return "the server failed; see its log"
