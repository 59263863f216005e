"""`serve`'s structured output and tool calls, driven by the official `openai` client on a
tiny byte-level model: `response_format` gives JSON valid under its schema, a required
tool gives a parsed call whose streamed deltas reassemble, and bad requests get 400s."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import jsonschema
import msgspec
import openai
import pytest
import trio

from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.config import EngineConfig
from lever_actors.model.grammar import Grammar
from lever_actors.serve import serve
from lever_actors.serve.options import ServeOptions
from lever_actors.testing import BYTE_VOCAB, TINY_ARGS, model_pair, reference_tokens
from lever_actors.text.tool_calls import call_grammar, read_calls

BYTE_ARGS = msgspec.structs.replace(TINY_ARGS, vocab_size=BYTE_VOCAB, max_seq_len=1024)
TIMEOUT = 60
NEW = 128  # enough for a random model to complete the schemas and calls below
# a Hermes-style template, as Qwen2.5's: tools shown, calls and their answers rendered
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}</{{ m.role }}>{% endfor %}<assistant>"
)
COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "blue"]}, "dark": {"type": "boolean"}},
    "required": ["color", "dark"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    pair = model_pair(BYTE_ARGS, "perturbed", 0, tokenizer="bytes")
    target = tmp_path_factory.mktemp("layout") / "target"
    shutil.copytree(pair.target, target)
    settings = target / "tokenizer_config.json"
    settings.write_text(json.dumps(json.loads(settings.read_text()) | {"chat_template": TEMPLATE}))
    return EngineConfig(target=str(target), draft=str(pair.draft), tree="chain:3")


def expected_text(config: EngineConfig, messages, grammar: Grammar, tools=None) -> str:
    tokenizer = Tokenizer.from_file(Path(config.target) / "tokenizer.json")
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, tools))
    tokens = reference_tokens(Path(config.target), prompt, NEW, grammar=grammar)
    return tokenizer.decode(tokens, skip_special=True)


async def start(nursery: trio.Nursery, config: EngineConfig) -> openai.AsyncOpenAI:
    [base] = await nursery.start(partial(serve, config, ServeOptions(port=0)))
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


async def test_a_json_schema_response_is_valid_json_and_the_targets_own(config):
    schema_format = {"type": "json_schema", "json_schema": {"name": "color", "schema": COLOR}}
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            api = await start(nursery, config)
            ask = dict(model="lever", messages=ASK, max_tokens=NEW, temperature=0)
            whole = await api.chat.completions.create(**ask, response_format=schema_format)
            stream = await api.chat.completions.create(
                **ask, response_format=schema_format, stream=True
            )
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
            anything = await api.chat.completions.create(
                **ask, response_format={"type": "json_object"}
            )
            nursery.cancel_scope.cancel()
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), COLOR)
    assert text == streamed == expected_text(config, ASK, Grammar.json_schema(COLOR))
    assert anything.choices[0].message.content == expected_text(config, ASK, Grammar("json"))


async def test_a_required_tool_is_called_and_its_streamed_deltas_reassemble(config):
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            api = await start(nursery, config)
            ask = dict(
                model="lever",
                messages=ASK,
                max_tokens=NEW,
                temperature=0,
                tools=[WEATHER],
                tool_choice="required",
                parallel_tool_calls=False,
            )
            whole = await api.chat.completions.create(**ask)
            stream = await api.chat.completions.create(**ask, stream=True)
            chunks = [c async for c in stream]
            nursery.cancel_scope.cancel()
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert not choice.message.content
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert [d.function.name for d in deltas if d.function.name] == ["weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    functions = [WEATHER["function"]]
    grammar = call_grammar(functions, many=False, marker_tokens=True)
    _, [expected] = read_calls(expected_text(config, ASK, grammar, functions))
    assert (expected.name, expected.arguments) == (call.function.name, call.function.arguments)


async def test_a_tool_answer_goes_back_to_the_model_through_its_template(config):
    """The round trip as an agent makes it: the assistant's call and the tool's answer are
    sent back, rendered by the template (a call's arguments as JSON), and answered."""
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "weather", "arguments": '{"city": "Oslo"}'}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            api = await start(nursery, config)
            answer = await api.chat.completions.create(
                model="lever", messages=history, max_tokens=8, temperature=0, tools=[WEATHER]
            )
            nursery.cancel_scope.cancel()
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"response_format": {"type": "json_schema"}}, "goes with type json_schema"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 3}},
                }
            },
            "type must be",
        ),
        ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice names 'f': not in tools",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "not both",
        ),
    ],
)
async def test_a_bad_structured_request_gets_a_400(config, fields, message):
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            api = await start(nursery, config)
            with pytest.raises(openai.BadRequestError, match=message):
                await api.chat.completions.create(model="lever", messages=ASK, **fields)
            nursery.cancel_scope.cancel()
