"""`POST /v1/responses` (#66, item 1) through the official `openai` client: whole and
streamed it answers the text chat completions answers for the same input and settings; a
JSON schema in `text.format` gives valid JSON; a function tool's call is an output item
whose answer, sent back with `previous_response_id`, reaches the model; an id the server
no longer holds is a 404."""

from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import openai
import pytest
import trio

from lever_actors.errors import ConfigError
from lever_actors.serve.responses import ResponsesRequest
from tests.serve.test_serve_grammar import ASK, COLOR, NEW, TIMEOUT, WEATHER, start
from tests.serve.test_serve_grammar import config as byte_config

config = byte_config  # the tiny byte-level model with a Hermes-style chat template


async def test_a_response_is_the_chat_completions_text_whole_and_streamed(config):
    # the SDK has no `seed` argument for responses: it goes in the body as it is
    asked = dict(model="lever", max_output_tokens=NEW, temperature=0.7, extra_body={"seed": 3})
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            api = await start(nursery, config)
            chat = await api.chat.completions.create(
                model="lever",
                messages=[{"role": "system", "content": "Be brief."}, *ASK],
                max_tokens=NEW,
                temperature=0.7,
                seed=3,
            )
            whole = await api.responses.create(
                **asked, instructions="Be brief.", input=ASK[0]["content"]
            )
            stream = await api.responses.create(
                **asked, instructions="Be brief.", input=ASK, stream=True
            )
            events = [event async for event in stream]
            nursery.cancel_scope.cancel()
    text = chat.choices[0].message.content
    assert whole.output_text == text and whole.id.startswith("resp_")
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] == f"response.{events[-1].response.status}" == f"response.{whole.status}"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == text
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_a_json_schema_format_gives_valid_json(config):
    schema = {"type": "json_schema", "name": "color", "schema": COLOR}
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            api = await start(nursery, config)
            response = await api.responses.create(
                model="lever",
                input=ASK,
                max_output_tokens=NEW,
                temperature=0,
                text={"format": schema},
            )
            nursery.cancel_scope.cancel()
    jsonschema.validate(json.loads(response.output_text), COLOR)


async def test_a_function_call_round_trips_through_previous_response_id(config):
    tool = {"type": "function", **WEATHER["function"]}
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            api = await start(nursery, config)
            asked = dict(model="lever", max_output_tokens=NEW, temperature=0)
            called = await api.responses.create(
                **asked,
                input=ASK,
                tools=[tool],
                tool_choice="required",
                parallel_tool_calls=False,
            )
            [call] = [item for item in called.output if item.type == "function_call"]
            answered = await api.responses.create(
                **asked,
                previous_response_id=called.id,
                input=[
                    {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}
                ],
            )
            plain = await api.responses.create(**asked, input=ASK)
            with pytest.raises(openai.NotFoundError, match="not held by this server"):
                await api.responses.create(**asked, input="Hi", previous_response_id="resp_x")
            nursery.cancel_scope.cancel()
    assert call.name == "weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    # the answer's prompt holds the question, the call and the tool's output (tools are not
    # carried over, as OpenAI's are not)
    assert answered.usage.input_tokens > plain.usage.input_tokens + len("Sunny")
    assert answered.output_text and answered.previous_response_id == called.id


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"input": "hi", "reasoning": {}}, "unknown field `reasoning`"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "needs call_id, name and"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "needs call_id and"),
        ({"input": [{"content": "hi"}]}, "input[0]: a message needs a role"),
    ],
)
def test_a_bad_response_request_is_refused_by_what_is_wrong(body, error):
    with pytest.raises((msgspec.ValidationError, ConfigError), match=re.escape(error)):
        msgspec.convert(body, ResponsesRequest).as_chat([])
