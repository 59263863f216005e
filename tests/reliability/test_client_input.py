"""Client input that used to get a 500 and a traceback (#64, E8) gets a 400 in OpenAI's
body, and the server goes on answering: JSON nested a thousand levels deep in a schema or
in a tool's parameters, and a past assistant message whose tool-call arguments are not
JSON."""

from __future__ import annotations

import json
from functools import partial

import httpx
import pytest
import trio

from lever_actors.config import EngineConfig
from lever_actors.model import grammar_source
from lever_actors.serve import serve
from lever_actors.serve.options import ServeOptions
from lever_actors.testing import TINY_ARGS, model_pair

JSON_BODY = {"Content-Type": "application/json"}
ASK = [{"role": "user", "content": "t1 t2"}]


def nested(levels: int) -> str:
    """A JSON schema `levels` objects deep (twice as many levels of JSON)."""
    return '{"type":"object","properties":{"a":' * levels + '{"type":"object"}' + "}}" * levels


def with_schema(schema: str) -> str:
    format_ = {"type": "json_schema", "json_schema": {"name": "deep", "schema": "SCHEMA"}}
    body = {"model": "m", "messages": ASK, "max_tokens": 3, "response_format": format_}
    return json.dumps(body).replace('"SCHEMA"', schema)


def with_tool(parameters: str) -> str:
    tool = {"type": "function", "function": {"name": "f", "parameters": "SCHEMA"}}
    body = {"model": "m", "messages": ASK, "max_tokens": 3, "tools": [tool]}
    return json.dumps(body).replace('"SCHEMA"', parameters)


def with_past_call(arguments: str) -> str:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    return json.dumps({"model": "m", "messages": messages, "max_tokens": 3})


@pytest.fixture(scope="module")
def config() -> EngineConfig:
    pair = model_pair(TINY_ARGS, "perturbed", 0, tokenizer="words")
    return EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="chain:2")


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (with_schema(nested(1000)), "nests JSON deeper than the server reads"),
        (with_tool(nested(1000)), "nests JSON deeper than the server reads"),
        (with_past_call("{not json"), "messages[1]: a tool call's arguments are not JSON"),
    ],
    ids=["deep-schema", "deep-tool-parameters", "past-call-arguments"],
)
async def test_bad_client_input_is_a_400_and_the_server_goes_on(config, body, fragment):
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            base = (await nursery.start(partial(serve, config, ServeOptions(port=0))))[0]
            async with httpx.AsyncClient(base_url=base, headers=JSON_BODY) as http:
                refused = await http.post("/v1/chat/completions", content=body)
                fine = await http.post("/v1/chat/completions", json={"messages": ASK})
            nursery.cancel_scope.cancel()
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"
    assert fine.status_code == 200


async def test_a_schema_that_compiles_for_ever_is_a_400_naming_the_limit(config, monkeypatch):
    """#64 E3: 1,000 patternProperties compile for minutes in llguidance; the server checks
    a grammar in a child process killed at the limit, off its event loop, so /health
    answers all the while."""
    monkeypatch.setattr(grammar_source, "CHECK_SECONDS", 1.0)
    patterns = {f"^p{i}[a-z]{{2,8}}$": {"type": "string"} for i in range(1000)}
    schema = json.dumps({"type": "object", "patternProperties": patterns})
    waits: list[float] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            base = (await nursery.start(partial(serve, config, ServeOptions(port=0))))[0]
            async with httpx.AsyncClient(base_url=base, headers=JSON_BODY) as http:

                async def health() -> None:
                    while True:
                        asked = trio.current_time()
                        assert (await http.get("/health")).status_code == 200
                        waits.append(trio.current_time() - asked)
                        await trio.sleep(0.05)

                # The poller ends before its client closes, or it reads a closed socket.
                async with trio.open_nursery() as polling:
                    polling.start_soon(health)
                    started = trio.current_time()
                    refused = await http.post("/v1/chat/completions", content=with_schema(schema))
                    took = trio.current_time() - started
                    polling.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    assert refused.status_code == 400
    assert "did not compile within 1 s (the limit)" in refused.json()["error"]["message"]
    assert took < 10 and len(waits) >= 5 and max(waits) < 2  # not blocked for minutes
