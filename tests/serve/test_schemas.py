"""A request body becomes the engine's GenerationOptions in one step, passed whole."""

from __future__ import annotations

import logging

import msgspec
import pytest

from lever_actors.errors import ConfigError
from lever_actors.model.grammar import Grammar
from lever_actors.model.sampling import Sampling
from lever_actors.options import GenerationOptions
from lever_actors.serve.schemas import ChatRequest, CompletionRequest


def test_a_completion_request_gives_its_options_whole():
    body = b'{"prompt": "x", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 3,'
    body += b' "stop": "\\n", "logprobs": 2}'
    request = msgspec.json.decode(body, type=CompletionRequest)
    assert request.options(16, 30.0) == GenerationOptions(
        max_new_tokens=5,
        stop=("\n",),
        sampling=Sampling(temperature=0.7, top_p=0.9, seed=3),
        deadline_seconds=30.0,
        top_logprobs=2,
    )


def test_a_chat_request_gives_its_options_whole():
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7,'
    body += b' "temperature": 0, "seed": 1, "stop": ["a", "b"], "logprobs": true,'
    body += b' "top_logprobs": 3, "response_format": {"type": "json_object"}}'
    request = msgspec.json.decode(body, type=ChatRequest)
    assert request.options(16, None) == GenerationOptions(
        max_new_tokens=7,
        stop=("a", "b"),
        sampling=Sampling(seed=1),  # greedy
        top_logprobs=3,
        grammar=Grammar("json"),
    )


def test_a_request_that_asks_nothing_samples_as_openai_does():
    defaults = msgspec.json.decode(b'{"prompt": [1], "seed": 0}', type=CompletionRequest)
    assert defaults.options(16, None) == GenerationOptions(
        max_new_tokens=16,
        sampling=Sampling(temperature=1.0, seed=0),  # OpenAI's: sampling
    )


def test_without_a_seed_one_is_drawn_and_logged(caplog):
    caplog.set_level(logging.INFO, logger="lever_actors")
    request = msgspec.json.decode(b'{"prompt": "x", "temperature": 0.5}', type=CompletionRequest)
    seeds = {request.options(16, None).sampling.seed for _ in range(4)}
    assert len(seeds) > 1
    assert sum("sampling seed drawn" in m for m in caplog.messages) == 4


@pytest.mark.parametrize(
    "body, message",
    [
        (b'{"prompt": "x", "logprobs": 6}', "logprobs = 6: expected 0 to 5"),
        (b'{"prompt": "x", "temperature": -1}', "temperature = -1.0"),
        (b'{"prompt": "x", "max_tokens": 0}', "max_new_tokens must be positive"),
        (b'{"prompt": "x", "stop": ["x", ""]}', "expected no empty string"),
    ],
)
def test_a_wrong_request_is_refused_when_its_options_are_made(body, message):
    with pytest.raises(ConfigError, match=message):
        msgspec.json.decode(body, type=CompletionRequest).options(16, None)
