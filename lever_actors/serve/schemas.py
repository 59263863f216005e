"""The OpenAI-compatible request and response bodies `serve` speaks, as msgspec structs.

Requests refuse unknown fields, so that a client that asks for something we do not do
(logit_bias) hears so instead of silently getting something else.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from lever_actors.channels.messages import FinishReason
from lever_actors.errors import ConfigError
from lever_actors.model.grammar import Grammar
from lever_actors.options import GenerationOptions, seeded_sampling
from lever_actors.text.finish import ReplyFinish, reply_finish
from lever_actors.text.tool_calls import ToolCall, call_grammar

Role = Literal["system", "user", "assistant", "tool"]
MAX_CHOICES = 8  # `n`: choices a request may ask for, each a request of the batch


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False  # a last chunk with the usage counts


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    schema: dict[str, Any] | None = None  # None: any JSON object
    description: str | None = None
    strict: bool | None = None  # accepted: the schema is always held to


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> Grammar | None:
        """The grammar the text must follow; None for plain text."""
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ConfigError("response_format.json_schema goes with type json_schema, and only")
        if self.json_schema is not None and self.json_schema.schema is not None:
            return Grammar.json_schema(self.json_schema.schema)
        return None if self.type == "text" else Grammar("json")


class Sampled(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields both endpoints share; the defaults are OpenAI's (temperature 1: sampling)."""

    model: str | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)] = 1  # choices, decoded together
    max_tokens: int | None = None  # default: the engine's
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    response_format: ResponseFormat | None = None

    def options(
        self, default_max_tokens: int, deadline_seconds: float | None, marker_tokens: bool = False
    ) -> GenerationOptions:
        """What the request asks of Engine.stream / generate, with the server's deadline,
        passed to it whole; ConfigError if it is wrong. `marker_tokens`: see `call_grammar`."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        top_logprobs = self.top_logprobs_asked() or 0
        grammar = self.grammar(marker_tokens)
        sampling = seeded_sampling(temperature=self.temperature, top_p=self.top_p, seed=self.seed)
        return GenerationOptions(
            max_new_tokens=self._max_tokens(default_max_tokens),
            stop=stop,
            sampling=sampling,
            deadline_seconds=deadline_seconds,
            top_logprobs=top_logprobs,
            grammar=grammar,
        )

    def grammar(self, marker_tokens: bool = False) -> Grammar | None:
        """The grammar the text must follow, if any."""
        return self.response_format.grammar() if self.response_format else None

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


class CalledFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text


class AssistantCall(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Role
    content: str | None = None  # an assistant's that only calls tools may have none
    tool_calls: list[AssistantCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's: the call it answers
    name: str | None = None

    def rendered(self, index: int) -> dict[str, Any]:
        """The message as chat templates take it: a call's arguments parsed."""
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            message["tool_calls"] = [_rendered_call(c, index) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message


def _rendered_call(call: AssistantCall, index: int) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise ConfigError(f"messages[{index}]: a tool call's arguments are not JSON") from None
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # accepted: a required call always follows the schema


class ToolDefinition(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedTool(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionName


class ChatRequest(Sampled, forbid_unknown_fields=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # alternatives per token, 0 to 20; needs logprobs
    tools: list[ToolDefinition] | None = None
    # "auto" where tools are given (the model may call them), "required" (it calls one or
    # more, under a grammar), a named function (it calls that one), "none" (no tools shown)
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True  # false: a required call is one call

    def top_logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ConfigError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def _max_tokens(self, default: int) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super()._max_tokens(default)

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as Engine.stream takes them."""
        return [m.rendered(i) for i, m in enumerate(self.messages)]

    def functions(self) -> list[dict[str, Any]] | None:
        """The function definitions the chat template shows, as sent (fields left out stay
        out); None: no tools."""
        if not self.tools or self.tool_choice == "none":
            return None
        given = (msgspec.structs.asdict(t.function).items() for t in self.tools)
        return [{k: v for k, v in fields if v is not None} for fields in given]

    def grammar(self, marker_tokens: bool = False) -> Grammar | None:
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none"):
            return super().grammar()
        functions = self.functions()
        if functions is None:
            raise ConfigError(f"tool_choice {_choice(choice)} needs tools")
        if self.response_format is not None:
            raise ConfigError(f"give response_format or tool_choice {_choice(choice)}, not both")
        if isinstance(choice, NamedTool):
            functions = [f for f in functions if f["name"] == choice.function.name]
            if not functions:
                raise ConfigError(f"tool_choice names {choice.function.name!r}: not in tools")
        return call_grammar(functions, self.parallel_tool_calls, marker_tokens)


def _choice(choice: str | NamedTool) -> str:
    return repr(choice.function.name) if isinstance(choice, NamedTool) else repr(choice)


def tool_calls_body(calls: list[ToolCall], streamed: bool) -> list[dict[str, Any]]:
    """OpenAI's `tool_calls`: whole in a message, or each with its index in a delta."""
    return [
        ({"index": i} if streamed else {})
        | {"id": c.id, "type": "function"}
        | {"function": {"name": c.name, "arguments": c.arguments}}
        for i, c in enumerate(calls)
    ]


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


class Answer(NamedTuple):
    """One choice of a whole response."""

    text: str
    finish: FinishReason | None
    logprobs: list[TokenLogprob] | None = None
    calls: list[ToolCall] | None = None


class Reply:
    """One response's identity (id, creation time, model name) and its body builders: a
    completion or a chat completion, whole or as stream chunks."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def whole(self, answers: Sequence[Answer], use: Usage) -> dict[str, Any]:
        """The whole response, a choice per answer; one with `calls` a chat message that
        calls tools."""
        body = self._head("chat.completion" if self.chat else "text_completion")
        return body | {"choices": [self._choice(i, a) for i, a in enumerate(answers)], "usage": use}

    def _choice(self, index: int, answer: Answer) -> dict[str, Any]:
        text, calls = answer.text, answer.calls
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message = message | {
                    "content": text or None,
                    "tool_calls": tool_calls_body(calls, False),
                }
            choice: dict[str, Any] = {"index": index, "message": message}
        else:
            choice = {"index": index, "text": text}
        logprobs = answer.logprobs
        choice["logprobs"] = None if logprobs is None else self.logprobs(logprobs, 0)
        return choice | {"finish_reason": reply_finish(answer.finish, bool(calls))}

    def chunk(
        self,
        text: str | None,
        finish: ReplyFinish | None = None,
        first: bool = False,
        logprobs: dict[str, Any] | None = None,
        calls: list[ToolCall] | None = None,
        index: int = 0,
    ) -> dict[str, Any]:
        """A stream chunk of choice `index` carrying `text` (None: none) or a chat's tool
        `calls`, and `finish` on the last one."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = tool_calls_body(calls, True)
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
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
