"""The OpenAI-compatible request and response bodies `serve` speaks, as msgspec structs.

Requests refuse unknown fields, so that a client that asks for something we do not do
(n > 1, logit_bias, tools) hears so instead of silently getting something else.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec

from lever_actors.channels.messages import FinishReason
from lever_actors.request import GenerationOptions, generation_options

Role = Literal["system", "user", "assistant"]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False  # a last chunk with the usage counts


class Sampled(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields both endpoints share; the defaults are OpenAI's (temperature 1: sampling)."""

    model: str | None = None
    max_tokens: int | None = None  # default: the engine's
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused

    def options(self, default_max_tokens: int, deadline_seconds: float | None) -> GenerationOptions:
        """What the request asks of Engine.stream / generate, with the server's deadline;
        ConfigError if it is wrong."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return generation_options(
            max_new_tokens=self._max_tokens(default_max_tokens),
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=stop,
            deadline_seconds=deadline_seconds,
        )

    def _max_tokens(self, default: int) -> int:
        return default if self.max_tokens is None else self.max_tokens


class CompletionRequest(Sampled, forbid_unknown_fields=True, kw_only=True):
    prompt: str | list[int]


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Role
    content: str


class ChatRequest(Sampled, forbid_unknown_fields=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens

    def _max_tokens(self, default: int) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super()._max_tokens(default)

    def conversation(self) -> list[dict[str, str]]:
        """The messages as Engine.stream takes them."""
        return [msgspec.structs.asdict(m) for m in self.messages]


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # whose KV an earlier request left (the prefix cache)


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))


class Reply:
    """One response's identity (id, creation time, model name) and its body builders: a
    completion or a chat completion, whole or as stream chunks."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def whole(self, text: str, finish: FinishReason | None, use: Usage) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        body = self._head("chat.completion" if self.chat else "text_completion")
        return body | {"choices": [choice | {"finish_reason": finish}], "usage": use}

    def chunk(
        self, text: str | None, finish: FinishReason | None = None, first: bool = False
    ) -> dict[str, Any]:
        """A stream chunk carrying `text` (None: none), and `finish` on the last one."""
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None}
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return body | {"choices": [choice | {"finish_reason": finish}]}

    def usage_chunk(self, use: Usage) -> dict[str, Any]:
        """The stream's last chunk when the client asked for usage: no choices."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(kind) | {"choices": [], "usage": use}

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def error_body(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
