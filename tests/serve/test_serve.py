"""`serve` on a tiny model at 127.0.0.1, driven by the official `openai` client and by raw
HTTP: exact text streamed and whole, concurrent clients, the queue's 429, a client that
leaves mid-stream, bad requests answered 4xx with OpenAI's error body, bodies only as
JSON, Host checked against rebinding, and SIGTERM draining (streams cut with a last chunk,
new requests 503); Ctrl-C and SIGTERM from the command line."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import aclosing
from functools import partial
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import trio

from lever_actors.config import ChannelSizes, EngineConfig
from lever_actors.engine import Engine
from lever_actors.errors import CheckpointError, ConfigError
from lever_actors.model.sampling import Sampling
from lever_actors.serve import serve
from lever_actors.serve.app import build_app
from lever_actors.serve.options import ServeOptions
from lever_actors.testing import TINY_ARGS, model_pair, reference_tokens

KEY = "sk-test"
AUTHORIZED = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
NEW = 10
TIMEOUT = 60


@pytest.fixture(scope="module")
def config() -> EngineConfig:
    pair = model_pair(TINY_ARGS, "perturbed", 0, tokenizer="words")
    return EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="chain:3")


def text_of(config: EngineConfig, prompt: list[int], sampling: Sampling | None = None) -> str:
    tokens = reference_tokens(Path(config.target), prompt, NEW, sampling=sampling or Sampling())
    return "".join(f" t{t}" for t in tokens)  # what the prompt's text gains: a space per word


async def start(nursery: trio.Nursery, config: EngineConfig, **kw) -> str:
    binds = await nursery.start(partial(serve, config, ServeOptions(port=0, api_key=KEY, **kw)))
    return binds[0]


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)


async def test_the_openai_client_gets_exact_text_streamed_and_whole(config):
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            base = await start(nursery, config)
            api = client(base)
            whole = await api.completions.create(
                model="lever", prompt="t3 t1 t4", max_tokens=NEW, temperature=0
            )
            chunks = await api.completions.create(
                model="lever",
                prompt="t3 t1 t4",
                max_tokens=NEW,
                temperature=0.8,
                seed=7,
                stream=True,
            )
            streamed = [chunk async for chunk in chunks]
            chat = await api.chat.completions.create(
                model="lever",
                messages=[
                    {"role": "system", "content": "t3"},
                    {"role": "user", "content": "t1 t4"},
                ],
                max_tokens=NEW,
                temperature=0,
            )
            models = await api.models.list()
            nursery.cancel_scope.cancel()
    assert whole.choices[0].text == text_of(config, [3, 1, 4])
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (3, NEW)
    sampled = text_of(config, [3, 1, 4], Sampling(temperature=0.8, seed=7))
    assert "".join(c.choices[0].text for c in streamed) == sampled
    assert streamed[-1].choices[0].finish_reason == "length"
    assert chat.choices[0].message.content == text_of(config, [3, 1, 4])
    assert [m.id for m in models.data] == ["lever"]


async def test_a_conversations_next_turn_reuses_its_prefix_and_reports_it(config):
    """The history resent, as chat UIs do: the second request prefills only its new part,
    says so in usage.prompt_tokens_details, and its text is a cold start's."""
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            api = client(await start(nursery, config))
            first = await api.completions.create(
                model="lever", prompt="t3 t1 t4", max_tokens=NEW, temperature=0
            )
            history = "t3 t1 t4" + first.choices[0].text + " t5"
            second = await api.completions.create(
                model="lever", prompt=history, max_tokens=NEW, temperature=0
            )
            nursery.cancel_scope.cancel()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    prompt = [int(word[1:]) for word in history.split()]
    assert second.usage.prompt_tokens == len(prompt)
    assert second.usage.prompt_tokens_details.cached_tokens >= 3  # the first prompt at least
    assert second.choices[0].text == text_of(config, prompt)


async def test_raw_http_streams_server_sent_events_and_health(config):
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            base = await start(nursery, config)
            headers = {"Authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(base_url=base, headers=headers) as http:
                health = await http.get("/health")
                body = {
                    "messages": [{"role": "user", "content": "t3 t1 t4"}],
                    "max_tokens": NEW,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    lines = [line async for line in response.aiter_lines() if line]
            nursery.cancel_scope.cancel()
    assert health.json()["status"] == "ok"
    assert response.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == text_of(config, [3, 1, 4])
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": NEW,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


@pytest.mark.parametrize(("queue", "parallel"), [(8, 1), (2, 1), (2, 3)])
async def test_eight_concurrent_clients_each_get_their_text_or_a_429(config, queue, parallel):
    prompts = [[3, 1, 4], [1, 5, 9], [2, 6], [5, 3, 5], [8, 9, 7], [9, 3], [2, 3, 8, 4], [6, 2]]
    answers: dict[int, object] = {}

    async def ask(api, index):
        words = " ".join(f"t{t}" for t in prompts[index])
        try:
            reply = await api.completions.create(
                model="lever", prompt=words, max_tokens=NEW, temperature=0
            )
            answers[index] = reply.choices[0].text
        except openai.RateLimitError as e:
            answers[index] = e

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            base = await start(
                nursery, msgspec.structs.replace(config, parallel=parallel), queue=queue
            )
            api = client(base)
            async with trio.open_nursery() as clients:
                for index in range(len(prompts)):
                    clients.start_soon(ask, api, index)
            nursery.cancel_scope.cancel()
    refused = [i for i, a in answers.items() if isinstance(a, openai.RateLimitError)]
    for index, answer in answers.items():
        if index not in refused:
            assert answer == text_of(config, prompts[index]), f"client {index}"
    if queue == 8:
        assert refused == []
    else:  # `parallel` running, two waiting: the rest are told to come back
        assert len(refused) == len(prompts) - parallel - queue
        assert all(answers[i].response.headers["retry-after"] == "5" for i in refused)


async def test_health_shows_the_requests_decoding_and_those_waiting(config):
    body = {"prompt": "t3 t1 t4", "max_tokens": 200, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            base = await start(nursery, msgspec.structs.replace(config, parallel=2))
            async with httpx.AsyncClient(base_url=base, headers=headers) as http:

                async def hold():  # a stream read slowly: its request keeps its place
                    async with http.stream("POST", "/v1/completions", json=body) as response:
                        async for _ in response.aiter_lines():
                            await trio.sleep(1)

                async with trio.open_nursery() as clients:
                    for _ in range(3):
                        clients.start_soon(hold)
                    while True:  # all three inside the engine: two decoding, one waiting
                        health = (await http.get("/health")).json()
                        if health["active"] + health["queued"] == 3:
                            break
                        await trio.sleep(0.01)
                    clients.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    assert (health["active"], health["queued"], health["parallel"]) == (2, 1, 2)


async def test_a_client_that_leaves_mid_stream_cancels_its_request(config):
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            base = await start(nursery, config)
            headers = {"Authorization": f"Bearer {KEY}"}
            body = {"prompt": "t3 t1 t4", "max_tokens": 200, "temperature": 0, "stream": True}
            async with httpx.AsyncClient(base_url=base, headers=headers) as http:
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            break  # gone after the first token
                after = await client(base).completions.create(
                    model="lever", prompt="t3 t1 t4", max_tokens=NEW, temperature=0
                )
                health = (await http.get("/health")).json()
            nursery.cancel_scope.cancel()
    assert after.choices[0].text == text_of(config, [3, 1, 4])
    assert health["requests"] == 0  # the abandoned request no longer holds a place


async def test_n_choices_with_a_seed_are_the_same_each_time_and_each_exact(config):
    """#66 item 2: `n` choices decode together, whole or streamed; choice i samples with the
    seed plus i, so the same request gives the same choices, choice 0 is the request alone,
    and usage counts every choice's tokens."""
    asked = {"model": "lever", "prompt": "t3 t1 t4", "max_tokens": NEW, "temperature": 0.9}
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            api = client(await start(nursery, config))
            twice = [await api.completions.create(**asked, n=3, seed=11) for _ in range(2)]
            stream = await api.completions.create(
                **asked, n=3, seed=11, stream=True, stream_options={"include_usage": True}
            )
            chunks = [chunk async for chunk in stream]
            chat = await api.chat.completions.create(
                model="lever",
                messages=[{"role": "user", "content": "t1 t4"}],
                max_tokens=NEW,
                temperature=0,
                n=2,
            )
            nursery.cancel_scope.cancel()
    first, again = ([c.text for c in r.choices] for r in twice)
    expected = [
        text_of(config, [3, 1, 4], Sampling(temperature=0.9, seed=11 + i)) for i in range(3)
    ]
    assert first == again == expected and len(set(first)) > 1
    assert [c.index for c in twice[0].choices] == [0, 1, 2]
    streamed = [
        "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(3)
    ]
    assert streamed == expected and chunks[-1].usage.completion_tokens == 3 * NEW
    assert (twice[0].usage.prompt_tokens, twice[0].usage.completion_tokens) == (3, 3 * NEW)
    greedy = [c.message.content for c in chat.choices]
    assert greedy == [greedy[0]] * 2 and chat.usage.completion_tokens == 2 * NEW


@pytest.mark.parametrize(
    ("body", "headers", "status", "fragment"),
    [
        ("{not json", None, 400, "not valid JSON"),
        ({"prompt": "t1", "logit_bias": {}}, None, 400, "unknown field `logit_bias`"),
        ({"prompt": "t1", "n": 9}, None, 400, "Expected `int` <= 8 - at `$.n`"),
        ({"prompt": "t1", "max_tokens": 0}, None, 400, "max_new_tokens"),
        ({"prompt": "t1", "temperature": -1}, None, 400, "temperature = -1"),
        ({"prompt": "t1", "temperature": 1e-300}, None, 400, "temperature = 1e-300: expected 0"),
        ({"prompt": "t1", "temperature": 5e-324}, None, 400, "temperature = 5e-324: expected 0"),
        ({"prompt": 5}, None, 400, "Expected `str | array`"),
        ({"prompt": "t1", "stop": [""]}, None, 400, "stop = ['']: expected no empty string"),
        ({"prompt": "t1", "stop": ""}, None, 400, "stop = ['']: expected no empty string"),
        ({"prompt": "t1"}, {"Authorization": "Bearer wrong"}, 401, "incorrect API key"),
        ({"prompt": "t1"}, {}, 401, "incorrect API key"),
        *[  # what a web page may post to a local server without asking first
            (
                {"prompt": "t1"},
                {"Authorization": f"Bearer {KEY}"} | media,
                415,
                f"send the body as Content-Type: application/json, not {name}",
            )
            for media, name in [
                ({"Content-Type": "text/plain"}, "text/plain"),
                ({"Content-Type": "application/x-www-form-urlencoded"}, "application/x-www-"),
                ({"Content-Type": "multipart/form-data; boundary=x"}, "multipart/form-data"),
                ({}, "none"),
            ]
        ],
    ],
)
async def test_bad_requests_get_4xx_with_an_openai_error_body(
    config, body, headers, status, fragment
):
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            base = await start(nursery, config)
            sent_headers = AUTHORIZED if headers is None else headers
            content = body if isinstance(body, str) else json.dumps(body)
            async with httpx.AsyncClient(base_url=base, headers=sent_headers) as http:
                response = await http.post("/v1/completions", content=content)
                missing = await http.get("/v1/nothing")
            nursery.cancel_scope.cancel()
    assert response.status_code == status
    assert fragment in response.json()["error"]["message"]
    assert missing.status_code == 404 and "error" in missing.json()


async def test_a_prompt_beyond_the_context_gets_context_length_exceeded(config):
    small = msgspec.structs.replace(config, ctx_size=12)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            base = await start(nursery, small)
            auth = {"Authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(base_url=base, headers=auth) as http:
                body = {"model": "lever", "prompt": "t1 t2 t3 t4", "max_tokens": 9}
                response = await http.post("/v1/completions", json=body)
                health = await http.get("/health")
            nursery.cancel_scope.cancel()
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert (error["n_prompt_tokens"], error["n_ctx"]) == (4, 12)
    assert health.json()["n_ctx"] == 12


@pytest.mark.parametrize(
    ("host", "allowed", "status"),
    [
        ("evil.example:8000", None, 421),  # a page's own name, rebound to 127.0.0.1
        ("localhost:8000", None, 200),
        ("127.0.0.1", None, 200),
        ("[::1]:8000", None, 200),
        ("", None, 421),
        ("lever.lan:8000", ["lever.lan"], 200),
        ("LEVER.lan:8000", ["Lever.LAN"], 200),
        ("[::1]:8000", ["[::1]"], 200),  # an address as a URL writes it
        ("[::1]:8000", ["::1"], 200),
        ("localhost:8000", ["lever.lan"], 421),
    ],
)
async def test_a_loopback_server_answers_only_its_own_host_names(config, host, allowed, status):
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            base = await start(nursery, config, allowed_hosts=allowed)
            async with httpx.AsyncClient(base_url=base, headers=AUTHORIZED) as http:
                health = await http.get("/health", headers={"Host": host})
                models = await http.get("/v1/models", headers={"Host": host})
            nursery.cancel_scope.cancel()
    assert (health.status_code, models.status_code) == (status, status)
    if status == 421:
        error = models.json()["error"]
        assert error["message"] == f"Host {host!r} is not one this server answers to"
        assert error["code"] == "host_not_allowed"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(queue=-1), "queue = -1: expected >= 0"),
        (dict(grace=-1.0), "grace = -1.0: expected >= 0 seconds"),
        (dict(default_max_tokens=0), "max_new_tokens must be positive, got 0"),
        (dict(port=99999), "port 99999: expected 0 to 65535"),
        (dict(host="a..b"), "host 'a..b': not a host name"),
        (dict(deadline_seconds=0.0), "deadline_seconds = 0.0: expected > 0"),
        (dict(max_body=0), "max_body = 0: expected >= 1 byte"),
    ],
)
async def test_bad_settings_are_refused_before_the_engine_opens(
    config, monkeypatch, settings, message
):
    def opened(*args, **kwargs):
        raise AssertionError("the engine opened before the settings were checked")

    monkeypatch.setattr(Engine, "open", opened)
    with pytest.raises(ConfigError) as raised:
        await serve(config, ServeOptions(**({"port": 0} | settings)))
    assert str(raised.value) == message


async def test_a_keyless_server_off_loopback_is_warned_about(config, caplog, tmp_path):
    missing = msgspec.structs.replace(config, target=str(tmp_path / "missing"))
    for host in ("127.0.0.1", "0.0.0.0"):  # the engine fails to open: nothing ever listens
        with pytest.raises(CheckpointError):
            await serve(missing, ServeOptions(host=host, port=0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["serving 0.0.0.0 without an API key: whoever reaches it can use it"]


async def test_a_bug_is_a_500_with_an_openai_error_body(config, monkeypatch):
    async def bug(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(Engine, "generate", bug)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            base = await start(nursery, config)
            async with httpx.AsyncClient(base_url=base, headers=AUTHORIZED) as http:
                response = await http.post("/v1/completions", json={"prompt": "t1"})
            nursery.cancel_scope.cancel()
    assert response.status_code == 500
    assert response.json()["error"] == {
        "message": "the server failed; see its log",
        "type": "server_error",
        "param": None,
        "code": None,
    }


def slowed(monkeypatch, seconds: float) -> None:
    """Engine.stream_choices with `seconds` before each event, and Engine.generate a minute
    late: requests that last."""
    stream, generate = Engine.stream_choices, Engine.generate

    async def slow_stream(self, *args, **kwargs):
        async with aclosing(stream(self, *args, **kwargs)) as events:
            async for pair in events:
                await trio.sleep(seconds)
                yield pair

    async def slow_generate(self, *args, **kwargs):
        await trio.sleep(60)
        return await generate(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "stream_choices", slow_stream)
    monkeypatch.setattr(Engine, "generate", slow_generate)


async def test_sigterm_cuts_requests_after_the_grace_and_refuses_new_ones(config, monkeypatch):
    slowed(monkeypatch, 0.1)
    streamed = {"prompt": "t3 t1 t4", "max_tokens": 50, "temperature": 0, "stream": True}
    whole = streamed | {"stream": False}
    answers = {}

    async def ask_whole(http):
        answers["whole"] = await http.post("/v1/completions", json=whole)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:  # ends when serve returns by itself
            base = await start(nursery, config, grace=0.5)
            async with httpx.AsyncClient(base_url=base, headers=AUTHORIZED) as http:
                async with http.stream("POST", "/v1/completions", json=streamed) as response:
                    lines = response.aiter_lines()
                    first = await anext(lines)
                    nursery.start_soon(ask_whole, http)
                    while (await http.get("/health")).json()["requests"] < 2:
                        await trio.sleep(0.01)
                    os.kill(os.getpid(), signal.SIGTERM)
                    await trio.sleep(0.1)
                    refused = await http.post("/v1/completions", json=whole)
                    rest = [line async for line in lines if line]
    chunks = [json.loads(line.removeprefix("data: ")) for line in [first, *rest[:-1]]]
    assert rest[-1] == "data: [DONE]"
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": "length",
    }
    assert 2 <= len(chunks) < 50  # cut after half a second, not run to its end
    assert refused.status_code == 503
    assert refused.json()["error"]["message"] == "the server is shutting down"
    assert answers["whole"].status_code == 503
    assert answers["whole"].json()["error"]["message"] == "the server shut down first"


async def test_client_errors_are_logged_in_one_line(config, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="lever_actors")  # a CLI test may have raised it
    accept, failures = trio.SocketListener.accept, [OSError(errno.EMFILE, "Too many open files")]

    async def out_of_files(self):  # once: trio waits 0.1 s and accepts again
        if failures:
            raise failures.pop()
        return await accept(self)

    monkeypatch.setattr(trio.SocketListener, "accept", out_of_files)
    left = "a client left during its request's body path=/v1/completions"
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            base = await start(nursery, config)
            port = int(base.rsplit(":", 1)[1])
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                "Content-Length: 1000\r\n\r\n"
            )
            await stream.send_all(head.encode() + b'{"prompt": ')
            await stream.aclose()  # gone before the rest of its body
            while left not in caplog.messages:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert (
        "accept returned EMFILE (Too many open files); retrying in 0.1 seconds" in caplog.messages
    )
    assert [r.exc_info for r in caplog.records] == [None] * len(caplog.records)  # no traceback


DRAINING = "lever_actors.serve: SIGTERM: shutting down"
LAUNCH = "from lever_actors.launch import console; console()"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def until_listening(child: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while child.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("serve never listened")


@pytest.mark.parametrize(
    ("sent", "code", "last_line"),
    [
        (signal.SIGINT, 130, "lever-actors: interrupted"),
        (
            signal.SIGTERM,
            0,
            "WARNING lever_actors.serve: SIGTERM: shutting down grace_seconds=10.0",
        ),
    ],
)
def test_the_command_ends_in_one_line_on_ctrl_c_and_shuts_down_on_sigterm(
    config, sent, code, last_line
):
    port = free_port()
    flags = ["--target", config.target, "--draft", config.draft, "--tree", "chain:3"]
    command = [sys.executable, "-c", LAUNCH, "serve", *flags, "--port", str(port)]
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True) as child:
        until_listening(child, port)
        child.send_signal(sent)
        _, err = child.communicate(timeout=TIMEOUT)
    assert child.returncode == code, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == last_line
    lines = err.splitlines()
    assert "plan: trees" in lines  # the tree given: followed as given
    assert any(line.startswith("memory: limit ") for line in lines)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_before_its_answer_cancels_its_request(config, caplog, stream):
    """Whole, or streamed before its first token (a prefill): the engine is free again at
    once, not after the generation the client no longer waits for."""
    caplog.set_level(logging.INFO, logger="lever_actors")
    # steps of up to a second, one request at a time
    slow = msgspec.structs.replace(config, jitter_seconds=0.2, parallel=1)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            base = await start(nursery, slow)
            port = int(base.rsplit(":", 1)[1])
            body = json.dumps(
                {"model": "lever", "prompt": "t1 t2", "max_tokens": 200, "stream": stream}
            )
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            client = await trio.open_tcp_stream("127.0.0.1", port)
            await client.send_all(head.encode() + body.encode())
            async with httpx.AsyncClient(base_url=base) as http:
                while (await http.get("/health")).json()["requests"] == 0:
                    await trio.sleep(0.01)
                await client.aclose()  # gone, the answer not begun
                left = trio.current_time()
                while (await http.get("/health")).json()["requests"]:
                    await trio.sleep(0.01)
                freed = trio.current_time() - left
            nursery.cancel_scope.cancel()
    assert freed < 3  # 200 steps of up to a second each would take minutes
    assert "a client left before its answer; its request was cancelled" in " ".join(caplog.messages)


@pytest.mark.parametrize("declared", [True, False])
async def test_a_body_over_the_limit_gets_413_before_it_is_read_whole(config, declared):
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            base = await start(nursery, config, max_body=1000)
            body = json.dumps({"model": "lever", "prompt": "t1 " * 500}).encode()

            async def chunks():  # no Content-Length: sent as it comes
                yield body

            auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
            async with httpx.AsyncClient(base_url=base, headers=auth) as http:
                content = body if declared else chunks()
                response = await http.post("/v1/completions", content=content)
                small = await http.post("/v1/completions", json={"prompt": "t1", "max_tokens": 2})
            nursery.cancel_scope.cancel()
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert small.status_code == 200


async def test_a_deadline_cuts_a_running_request_short_and_a_waiting_one_gets_504(config):
    # steps of up to a second, one request at a time
    slow = msgspec.structs.replace(config, jitter_seconds=0.2, parallel=1)
    body = {"model": "lever", "prompt": "t1 t2", "max_tokens": 200, "temperature": 0}
    answers = {}

    async def ask(name, http):
        answers[name] = await http.post("/v1/completions", json=body)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            base = await start(nursery, slow, deadline_seconds=1.5)
            async with httpx.AsyncClient(base_url=base, headers=AUTHORIZED, timeout=30) as http:
                async with trio.open_nursery() as asking:
                    asking.start_soon(ask, "running", http)
                    while (await http.get("/health")).json()["requests"] == 0:
                        await trio.sleep(0.01)
                    asking.start_soon(ask, "waiting", http)
            nursery.cancel_scope.cancel()
    running = answers["running"].json()
    assert running["choices"][0]["finish_reason"] == "length"
    assert 0 < running["usage"]["completion_tokens"] < 200
    assert answers["waiting"].status_code == 504
    error = answers["waiting"].json()["error"]
    assert (error["code"], error["message"]) == (
        "deadline_exceeded",
        "no token within the deadline of 1.5 s: the request was cancelled",
    )


async def test_a_stalled_reader_gives_up_its_place_when_the_engine_ends_its_request(config):
    """A client that stops reading a stream (its send blocks for good) keeps its connection,
    but once the engine has ended its request it no longer counts against the queue."""
    stalling = msgspec.structs.replace(
        config, stall_seconds=0.3, channels=ChannelSizes(events=1), jitter_seconds=0.02
    )
    body = json.dumps({"prompt": "t1 t2", "max_tokens": 200, "stream": True}).encode()
    sent: list[dict] = []
    bodies = [{"type": "http.request", "body": body, "more_body": False}]
    blocked = trio.Event()

    async def receive():
        if bodies:
            return bodies.pop()
        await trio.sleep_forever()  # never a disconnect: the client is still there

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and len(sent) > 2:
            blocked.set()
            await trio.sleep_forever()  # the client reads no more

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }
    with trio.fail_after(TIMEOUT):
        async with Engine.open(stalling) as engine:
            app = build_app(engine, ServeOptions(queue=0))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(app, scope, receive, send)
                await blocked.wait()
                admission = app.state.admission
                while admission.working:  # the engine ends it after stall_seconds
                    await trio.sleep(0.01)
                assert admission.inside == 1  # its response has not ended: a drain waits
                assert sent[0]["status"] == 200
                nursery.cancel_scope.cancel()


async def test_a_stop_string_is_left_out_of_the_text_streamed_and_whole(config):
    """As OpenAI's servers do: the text ends where the stop string begins."""
    full = text_of(config, [3, 1, 4])
    stop = full.split()[2]  # the third word, " tN": its text and all after it go
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            api = client(await start(nursery, config))
            asked = dict(model="lever", prompt="t3 t1 t4", max_tokens=NEW, temperature=0)
            whole = await api.completions.create(**asked, stop=[stop])
            chunks = await api.completions.create(**asked, stop=[stop], stream=True)
            streamed = "".join([chunk.choices[0].text async for chunk in chunks])
            nursery.cancel_scope.cancel()
    assert whole.choices[0].text == streamed == full[: full.index(stop)]
    assert whole.choices[0].finish_reason == "stop"


async def test_logprobs_come_with_their_alternatives_streamed_and_whole(config):
    """Greedy: each token is its position's likeliest, so it heads its own alternatives;
    the tokens' texts make the text, and the legacy lists' offsets count them."""
    full = text_of(config, [3, 1, 4])
    messages = [{"role": "user", "content": "t3 t1 t4"}]
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            api = client(await start(nursery, config))
            asked = dict(model="lever", messages=messages, max_tokens=NEW, temperature=0)
            chat = await api.chat.completions.create(**asked, logprobs=True, top_logprobs=3)
            chunks = await api.chat.completions.create(
                **asked, logprobs=True, top_logprobs=3, stream=True
            )
            streamed = [
                entry
                async for chunk in chunks
                if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content
            ]
            legacy = await api.completions.create(
                model="lever", prompt="t3 t1 t4", max_tokens=NEW, temperature=0, logprobs=2
            )
            refused = await _status_of(api, messages, top_logprobs=3)  # without logprobs
            nursery.cancel_scope.cancel()
    content = chat.choices[0].logprobs.content
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == 3 and top[0].token == entry.token and top[0].logprob == entry.logprob
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert entry.bytes == list(entry.token.encode())
    assert [e.token for e in streamed] == [e.token for e in content]
    # the same tokens; their figures from passes of other shapes (a cached prompt)
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], rel=1e-9)
    lp = legacy.choices[0].logprobs
    assert "".join(lp.tokens) == legacy.choices[0].text == full
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(
        len(top) == 2 and top[t] == p
        for top, t, p in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs, strict=True)
    )
    assert refused == 400


async def _status_of(api: openai.AsyncOpenAI, messages, **extra) -> int:
    try:
        await api.chat.completions.create(model="lever", messages=messages, max_tokens=2, **extra)
    except openai.BadRequestError as e:
        return e.status_code
    return 200
