"""OpenAI's Responses API (`POST /v1/responses`), as a chat completion in other clothes: a
request is read into a ChatRequest (its `input` items into messages, `instructions` first,
`text.format` into a response format, its function tools into chat tools), answered by the
chat path, and its answer written as a Response object, or streamed as the SDK's events
(`response.created` ... `response.output_text.delta` ... `response.completed`).

`previous_response_id` continues a conversation this server answered: it keeps the last
RESPONSES_KEPT conversations by response id, and the engine's prefix cache holds their KV,
so the continuation prefills only what is new; an id no longer kept is a 404."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Sequence
from typing import Any, Literal

import msgspec

from lever_actors.channels.messages import FinishReason, TokenEvent
from lever_actors.errors import ConfigError, ConsumerStalledError
from lever_actors.logs import get_logger
from lever_actors.serve.admission import Cut, Ticket
from lever_actors.serve.errors import ApiError, failure_message
from lever_actors.serve.metrics import Finished, ServerMetrics
from lever_actors.serve.schemas import (
    Answer,
    AssistantCall,
    CalledFunction,
    ChatMessage,
    ChatRequest,
    FunctionDefinition,
    FunctionName,
    JsonSchemaFormat,
    NamedTool,
    ResponseFormat,
    ToolDefinition,
    Usage,
    usage,
)
from lever_actors.text.tool_calls import CallText, ToolCall

log = get_logger(__name__)

RESPONSES_KEPT = 256  # conversations kept for previous_response_id


class ContentPart(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # an output_text's, sent back: accepted


class InputItem(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A message (`role`, `content`), a function call the model made (`call_id`, `name`,
    `arguments`) or its output (`call_id`, `output`)."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    id: str | None = None  # an output item's, sent back: accepted
    status: str | None = None  # likewise


class TextFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: TextFormat | None = None


class FunctionTool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stream: bool = False
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool | None = None  # accepted: every response is kept for a while
    user: str | None = None  # accepted, unused
    metadata: dict[str, str] | None = None  # accepted, unused

    def as_chat(self, earlier: Sequence[ChatMessage]) -> ChatRequest:
        """The chat completion that answers it, after the `earlier` conversation."""
        system = []
        if self.instructions:  # first, and not carried to a later response (as OpenAI's)
            system = [ChatMessage(role="system", content=self.instructions)]
        return ChatRequest(
            messages=[*system, *earlier, *self.messages()],
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stream=self.stream,
            response_format=self._format(),
            tools=[_chat_tool(t) for t in self.tools] if self.tools else None,
            tool_choice=_chat_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls,
        )

    def messages(self) -> list[ChatMessage]:
        """The input as chat messages: a run of function calls one assistant message."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        messages: list[ChatMessage] = []
        for index, item in enumerate(self.input):
            if item.type == "function_call":
                call = _called(item, index)
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant" and last.tool_calls:
                    last.tool_calls.append(call)
                else:
                    messages.append(ChatMessage(role="assistant", tool_calls=[call]))
            elif item.type == "function_call_output":
                if item.call_id is None or item.output is None:
                    raise ConfigError(
                        f"input[{index}]: a function_call_output needs call_id and output"
                    )
                messages.append(
                    ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id)
                )
            else:
                messages.append(_message(item, index))
        return messages

    def _format(self) -> ResponseFormat | None:
        given = self.text.format if self.text else None
        if given is None or given.type != "json_schema":
            return None if given is None else ResponseFormat(type=given.type)
        schema = JsonSchemaFormat(
            name=given.name or "response", schema=given.schema, description=given.description
        )
        return ResponseFormat(type="json_schema", json_schema=schema)


def _called(item: InputItem, index: int) -> AssistantCall:
    if item.call_id is None or item.name is None or item.arguments is None:
        raise ConfigError(f"input[{index}]: a function_call needs call_id, name and arguments")
    return AssistantCall(item.call_id, "function", CalledFunction(item.name, item.arguments))


def _message(item: InputItem, index: int) -> ChatMessage:
    if item.role is None:
        raise ConfigError(f"input[{index}]: a message needs a role")
    content = item.content
    text = (
        content if isinstance(content, str) or content is None else "".join(p.text for p in content)
    )
    return ChatMessage(role="system" if item.role == "developer" else item.role, content=text)


def _chat_tool(tool: FunctionTool) -> ToolDefinition:
    function = FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
    )
    return ToolDefinition("function", function)


def _chat_choice(
    choice: Literal["none", "auto", "required"] | FunctionChoice | None,
) -> Literal["none", "auto", "required"] | NamedTool | None:
    if isinstance(choice, FunctionChoice):
        return NamedTool("function", FunctionName(choice.name))
    return choice


class Conversations:
    """The last RESPONSES_KEPT conversations, by the id of the response that ended each."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, list[ChatMessage]] = OrderedDict()

    def before(self, previous: str | None) -> list[ChatMessage]:
        """The conversation `previous` ended (none without one); 404 where it is not kept."""
        if previous is None:
            return []
        if previous not in self._kept:
            raise ApiError(
                404,
                f"previous_response_id {previous!r} is not held by this server (it keeps the "
                f"last {RESPONSES_KEPT} responses, until it restarts)",
                "invalid_request_error",
                "previous_response_not_found",
            )
        self._kept.move_to_end(previous)
        return self._kept[previous]

    def keep(self, response_id: str, messages: list[ChatMessage]) -> None:
        self._kept[response_id] = messages
        while len(self._kept) > RESPONSES_KEPT:
            self._kept.popitem(last=False)


class ResponseWriter:
    """One response: its Response object, whole or as the SDK's stream of events, and the
    conversation it ends, kept for a later previous_response_id."""

    def __init__(
        self, asked: ResponsesRequest, chat: ChatRequest, model: str, kept: Conversations
    ) -> None:
        self.asked, self.chat, self.model, self.kept = asked, chat, model, kept
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._sequence = 0

    def whole(self, answers: Sequence[Answer], use: Usage) -> dict[str, Any]:
        """The Response object of a finished answer (one: `n` is not the API's), its
        conversation kept."""
        (answer,) = answers
        calls = answer.calls or []
        self._keep(answer.text, calls)
        return self._response("completed", self._output(answer.text, calls), answer.finish, use)

    async def events(
        self,
        first: TokenEvent,
        events: AsyncGenerator[tuple[int, TokenEvent], None],  # its one choice's
        with_tools: bool,
        metrics: ServerMetrics,
        ticket: Ticket,
    ) -> AsyncGenerator[bytes, None]:
        """The SDK's events for a streamed answer: created, the message's text in deltas,
        then its items done (function calls at the end) and completed, with usage; an
        `error` event where it fails or a drain cuts it."""
        try:
            async for part in self._streamed(first, events, with_tools, metrics):
                yield part
        except Cut:
            yield self._event(
                "error", message="the server is shutting down", code="shutting_down", param=None
            )
        except ConsumerStalledError as stalled:  # a reader that came back too late
            log.info("a stalled reader's request was ended", reason=str(stalled))
        except Exception as error:  # the headers went out: the stream says so, then ends
            log.exception("a streamed response failed")
            yield self._event("error", message=failure_message(error), code=None, param=None)
        finally:
            ticket.release()
            await events.aclose()  # a client gone mid-stream cancels the request here

    async def _streamed(
        self,
        first: TokenEvent,
        events: AsyncGenerator[tuple[int, TokenEvent], None],
        with_tools: bool,
        metrics: ServerMetrics,
    ) -> AsyncGenerator[bytes, None]:
        held = CallText() if with_tools else None
        yield self._event(
            "response.created", response=self._response("in_progress", [], None, None)
        )
        yield self._event(
            "response.output_item.added", output_index=0, item=self._message("", "in_progress")
        )
        part = {"type": "output_text", "text": "", "annotations": []}
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        yield self._event("response.content_part.added", **where, part=part)
        text, last = "", first
        async for event in _chained(first, events):
            last = event
            delta = held.push(event.text) if held else event.text
            if delta:
                text += delta
                yield self._event("response.output_text.delta", **where, delta=delta, logprobs=[])
        rest, calls = held.end() if held else ("", [])
        if rest:
            text += rest
            yield self._event("response.output_text.delta", **where, delta=rest, logprobs=[])
        metrics.finished(Finished.of_events(first, last))
        yield self._event("response.output_text.done", **where, text=text, logprobs=[])
        yield self._event("response.content_part.done", **where, part=part | {"text": text})
        message = self._message(text, "completed")
        yield self._event("response.output_item.done", output_index=0, item=message)
        for index, call in enumerate(calls, start=1):
            item = _function_call(call)
            yield self._event("response.output_item.added", output_index=index, item=item)
            yield self._event("response.output_item.done", output_index=index, item=item)
        self._keep(text, calls)
        use = usage(last.prompt_tokens, last.generated_tokens, last.cached_tokens)
        done = self._response("completed", self._output(text, calls), last.finish_reason, use)
        yield self._event(f"response.{done['status']}", response=done)  # or incomplete: cut

    def _keep(self, text: str, calls: list[ToolCall]) -> None:
        said = [AssistantCall(c.id, "function", CalledFunction(c.name, c.arguments)) for c in calls]
        answer = ChatMessage(role="assistant", content=text or None, tool_calls=said or None)
        instructions = 1 if self.asked.instructions else 0  # not carried over, as OpenAI's
        self.kept.keep(self.id, [*self.chat.messages[instructions:], answer])

    def _output(self, text: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
        message = [self._message(text, "completed")] if text or not calls else []
        return message + [_function_call(c) for c in calls]

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = (
            [{"type": "output_text", "text": text, "annotations": []}]
            if text or status == "completed"
            else []
        )
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _response(
        self,
        status: str,
        output: list[dict[str, Any]],
        finish: FinishReason | None,
        use: Usage | None,
    ) -> dict[str, Any]:
        asked = self.asked
        cut = finish == "length" and status == "completed"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if cut else status,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "error": None,
            "model": self.model,
            "instructions": asked.instructions,
            "max_output_tokens": asked.max_output_tokens,
            "output": output,
            "parallel_tool_calls": asked.parallel_tool_calls,
            "previous_response_id": asked.previous_response_id,
            "temperature": asked.temperature,
            "top_p": asked.top_p,
            "text": {
                "format": msgspec.to_builtins(asked.text.format)
                if asked.text and asked.text.format
                else {"type": "text"}
            },
            "tool_choice": msgspec.to_builtins(asked.tool_choice) if asked.tool_choice else "auto",
            "tools": msgspec.to_builtins(asked.tools or []),
            "usage": None if use is None else _usage_body(use),
            "metadata": asked.metadata or {},
        }

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self._sequence} | fields
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(body) + b"\n\n"


def _usage_body(use: Usage) -> dict[str, Any]:
    return {
        "input_tokens": use.prompt_tokens,
        "input_tokens_details": {"cached_tokens": use.prompt_tokens_details.cached_tokens},
        "output_tokens": use.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": use.total_tokens,
    }


def _function_call(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{call.id.removeprefix('call_')}",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }


async def _chained(
    first: TokenEvent, rest: AsyncGenerator[tuple[int, TokenEvent], None]
) -> AsyncGenerator[TokenEvent, None]:
    yield first
    async for _, event in rest:
        yield event
