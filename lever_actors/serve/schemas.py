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
from lever_actors.errors import ConfigError
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
            top_logprobs=self.top_logprobs_asked() or 0,
        )

    def top_logprobs_asked(self) -> int | None:
        """Each token's alternatives to report with its log-probability; None: no
        log-probabilities at all."""
        return None

    def _max_tokens(self, default: int) -> int:
        return default if self.max_tokens is None else self.max_tokens


class CompletionRequest(Sampled, forbid_unknown_fields=True, kw_only=True):
    prompt: str | list[int]
    logprobs: int | None = None  # the legacy API's: alternatives per token, 0 to 5

    def top_logprobs_asked(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise ConfigError(f"logprobs = {self.logprobs}: expected 0 to 5")
        return self.logprobs


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Role
    content: str


class ChatRequest(Sampled, forbid_unknown_fields=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # alternatives per token, 0 to 20; needs logprobs

    def top_logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ConfigError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

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


class TokenLogprob(msgspec.Struct, frozen=True):
    """One token's text and the target's log-probability, with its likeliest alternatives."""

    text: str
    logprob: float
    top: tuple[tuple[str, float], ...]

    def chat(self) -> dict[str, Any]:
        top = [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in self.top]
        return {
            "token": self.text,
            "logprob": self.logprob,
            "bytes": _bytes(self.text),
            "top_logprobs": top,
        }


def _bytes(text: str) -> list[int] | None:
    """The token's UTF-8 bytes; None where it is part of a character (its text replaced)."""
    return None if "\ufffd" in text else list(text.encode())


class Reply:
    """One response's identity (id, creation time, model name) and its body builders: a
    completion or a chat completion, whole or as stream chunks."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def whole(
        self,
        text: str,
        finish: FinishReason | None,
        use: Usage,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice["logprobs"] = None if logprobs is None else self.logprobs(logprobs, 0)
        body = self._head("chat.completion" if self.chat else "text_completion")
        return body | {"choices": [choice | {"finish_reason": finish}], "usage": use}

    def chunk(
        self,
        text: str | None,
        finish: FinishReason | None = None,
        first: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A stream chunk carrying `text` (None: none), and `finish` on the last one."""
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice["logprobs"] = logprobs
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return body | {"choices": [choice | {"finish_reason": finish}]}

    def logprobs(self, tokens: list[TokenLogprob], offset: int) -> dict[str, Any]:
        """The choice's `logprobs`: chat's `content` list, or the legacy completion's
        parallel lists (`text_offset` counting from `offset` characters)."""
        if self.chat:
            return {"content": [t.chat() for t in tokens]}
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token.text)
        return {
            "tokens": [t.text for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{text: lp for text, lp in t.top} for t in tokens],
            "text_offset": offsets,
        }

    def usage_chunk(self, use: Usage) -> dict[str, Any]:
        """The stream's last chunk when the client asked for usage: no choices."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(kind) | {"choices": [], "usage": use}

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def error_body(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
