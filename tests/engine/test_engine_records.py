"""What a request gives back beside the tokens: per-token records (finish reason, the
target's log-probability, counts, running tok/s), the result's totals, seeded sampling
through the API, chat messages through the model's template, and end tokens kept out of
the text."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
import trio

from lever_actors.actors import verifier as verifier_module
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.config import EngineConfig
from lever_actors.engine import Engine
from lever_actors.errors import ConfigError, EngineClosedError
from lever_actors.model.sampling import Sampling
from lever_actors.model.transformer import Transformer
from lever_actors.options import generation_options
from lever_actors.testing import TINY_ARGS, budget_bytes, model_pair, reference_tokens

PROMPT = [3, 1, 4, 1, 5]
NEW = 16
TIMEOUT = 30
# renders "t<system> t<user> ... t9": the tiny word-level tokenizer maps word ti to id i
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}t9{% endif %}"
)


def config(tree: str = "chain:3", **kw) -> EngineConfig:
    pair = model_pair(TINY_ARGS, "perturbed", 0, tokenizer="words", **kw)
    return EngineConfig(target=str(pair.target), draft=str(pair.draft), tree=tree)


async def events_of(engine: Engine, prompt=PROMPT, **kw) -> list:
    with trio.fail_after(TIMEOUT):
        return [e async for e in engine.stream(prompt, **kw)]


def target_model(layout: str) -> Transformer:
    checkpoint = load_checkpoint(Path(layout), torch.float64)
    return Transformer(checkpoint.args, checkpoint.weights)


async def test_each_event_carries_logprob_counts_rate_and_finish_reason():
    cfg = config()
    async with Engine.open(cfg) as engine:
        events = await events_of(engine, max_new_tokens=NEW)
    tokens = [e.token for e in events]
    assert tokens == reference_tokens(Path(cfg.target), PROMPT, NEW)
    assert [e.generated_tokens for e in events] == list(range(1, NEW + 1))
    assert {e.prompt_tokens for e in events} == {len(PROMPT)}
    assert [e.finish_reason for e in events] == [None] * (NEW - 1) + ["length"]
    first_step = [e for e in events if e.step == events[0].step]
    assert all(e.tokens_per_second is None for e in first_step)
    assert all(e.tokens_per_second > 0 for e in events[len(first_step) :])
    model = target_model(cfg.target)
    context = list(PROMPT)
    for event in events:  # the target's own log-softmax, before any temperature
        hidden = model.forward(torch.tensor(context), model.new_cache(len(context)))
        row = torch.log_softmax(model.logits(hidden[-1:])[0].double(), -1)
        assert event.logprob == pytest.approx(float(row[event.token]), abs=1e-9)
        context.append(event.token)


async def test_an_end_token_stops_with_reason_stop_and_stays_out_of_the_text():
    free = reference_tokens(Path(config().target), PROMPT, NEW)
    eos = free[5]
    cfg = config(eos_id=eos)
    async with Engine.open(cfg) as engine:
        result = await engine.generate(PROMPT, max_new_tokens=NEW)
    assert result.tokens == free[: free.index(eos) + 1]
    assert result.finish_reason == "stop"
    assert f"t{eos}" not in result.text.split()
    assert result.text.split() == [f"t{t}" for t in result.tokens[:-1]]


async def test_a_stop_string_stops_with_reason_stop_and_is_left_out_unless_kept():
    cfg = config()
    word = f"t{reference_tokens(Path(cfg.target), PROMPT, NEW)[3]}"
    async with Engine.open(cfg) as engine:
        result = await engine.generate(PROMPT, max_new_tokens=NEW, stop=[word])
        kept = await engine.generate(PROMPT, max_new_tokens=NEW, stop=[word], keep_stop=True)
    assert result.tokens == reference_tokens(Path(cfg.target), PROMPT, NEW, stop=[word])
    assert (result.finish_reason, kept.finish_reason) == ("stop", "stop")
    assert kept.tokens == result.tokens
    assert kept.text.endswith(word) and result.text == kept.text[: kept.text.index(word)]


async def test_the_result_carries_totals_and_peak_rss():
    async with Engine.open(config()) as engine:
        result = await engine.generate(PROMPT, max_new_tokens=NEW)
    assert (result.prompt_tokens, result.generated_tokens) == (len(PROMPT), NEW)
    assert result.finish_reason == "length"
    assert len(result.logprobs) == NEW and all(lp <= 0 for lp in result.logprobs)
    assert result.seed is None
    assert result.peak_rss_bytes > 10 * 2**20


async def test_a_drawn_seed_is_reported_and_reproduces_the_text(caplog):
    caplog.set_level(logging.INFO, logger="lever_actors")
    async with Engine.open(config()) as engine:
        first = await engine.generate(PROMPT, max_new_tokens=NEW, temperature=1.0)
        again = await engine.generate(PROMPT, max_new_tokens=NEW, temperature=1.0, seed=first.seed)
    assert first.seed is not None and again.tokens == first.tokens
    assert f"sampling seed drawn seed={first.seed}" in caplog.messages


@pytest.mark.parametrize("tree", ["none", "chain:4", "static:4,2,2,1", "gaincost"])
async def test_the_same_seed_gives_the_same_tokens_under_every_tree(tree):
    sampling = Sampling(temperature=0.9, top_p=0.9, seed=1234)
    cfg = config(tree)
    if tree == "none":
        cfg = msgspec.structs.replace(cfg, draft=None)
    expected = reference_tokens(Path(cfg.target), PROMPT, NEW, sampling=sampling)
    async with Engine.open(cfg) as engine:
        result = await engine.generate(
            PROMPT, max_new_tokens=NEW, **msgspec.structs.asdict(sampling)
        )
    assert result.tokens == expected
    assert expected != reference_tokens(Path(cfg.target), PROMPT, NEW), "sampled like greedy"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(temperature=-1.0), "temperature = -1.0: expected >= 0"),
        (dict(top_p=0.0), r"top_p = 0.0: expected in \(0, 1\]"),
        (dict(prompt=None), "give either prompt or messages"),
        (dict(messages=[{"role": "user", "content": "t1"}]), "give either prompt or messages"),
        (dict(stop="t3"), "stop must be a list of strings, not one string"),
    ],
)
async def test_bad_requests_are_refused_before_any_work(kw, message):
    async with Engine.open(config()) as engine:
        with pytest.raises(ConfigError, match=message):
            await engine.generate(kw.pop("prompt", PROMPT), max_new_tokens=NEW, **kw)


# ------------------------------------------------------------------ chat


@pytest.fixture
def chat_layout(tmp_path) -> EngineConfig:
    """The tiny target and draft, their tokenizers given TEMPLATE as chat template."""
    cfg = config()
    target = tmp_path / "target"
    shutil.copytree(cfg.target, target)
    tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return msgspec.structs.replace(cfg, target=str(target))


async def test_messages_go_through_the_chat_template(chat_layout):
    messages = [
        {"role": "system", "content": "t1"},
        {"role": "user", "content": "t2 t4"},
        {"role": "assistant", "content": "t5"},
        {"role": "user", "content": "t6"},
    ]
    async with Engine.open(chat_layout) as engine:
        chat = await engine.generate(messages=messages, max_new_tokens=NEW)
        raw = await engine.generate([1, 2, 4, 5, 6, 9], max_new_tokens=NEW)
        text = await engine.generate("t1 t2 t4 t5 t6 t9", max_new_tokens=NEW)
    assert chat.prompt_tokens == 6
    assert chat.tokens == raw.tokens == text.tokens


async def test_without_a_template_messages_are_joined_with_a_warning(caplog):
    messages = [{"role": "system", "content": "t1 t2"}, {"role": "user", "content": "t4"}]
    async with Engine.open(config()) as engine:
        chat = await engine.generate(messages=messages, max_new_tokens=NEW)
        raw = await engine.generate([1, 2, 4], max_new_tokens=NEW)
    assert chat.tokens == raw.tokens
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith("no chat template: the messages are joined as raw text model=")


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "messages must be a non-empty list"),
        ("t1", "messages must be a non-empty list"),
        ([{"role": "user"}], r"messages\[0\] must have the keys 'role' and 'content'"),
        ([{"role": "bot", "content": "t1"}], r"messages\[0\].role = 'bot': expected one of"),
        ([{"role": "user", "content": 3}], r"messages\[0\].content must be a string"),
    ],
)
async def test_bad_messages_are_refused(messages, message):
    async with Engine.open(config()) as engine:
        with pytest.raises(ConfigError, match=message):
            await engine.generate(messages=messages, max_new_tokens=NEW)


async def test_a_request_after_the_engine_closed_is_refused():
    async with Engine.open(config()) as engine:
        pass
    with pytest.raises(EngineClosedError, match="this engine was closed; open another"):
        await engine.generate(PROMPT, max_new_tokens=2)


async def test_a_long_prefill_reports_its_progress_through_the_layers(monkeypatch):
    monkeypatch.setattr(verifier_module, "PREFILL_SHOWN", 8)
    pair = model_pair(msgspec.structs.replace(TINY_ARGS, n_layers=4), "perturbed", 0)
    config = EngineConfig(
        target=str(pair.target), draft=str(pair.draft), dram_budget=budget_bytes(pair.target, 0.0)
    )
    heard: list[tuple[int, int, str]] = []
    prompt = list(range(1, 13))
    async with Engine.open(config) as engine:
        await engine.generate(prompt, max_new_tokens=3, progress=lambda *p: heard.append(p))
        await engine.generate([*prompt, 5], max_new_tokens=3, progress=lambda *p: heard.append(p))
    # the first prompt's pass, layer by layer as they stream; the second's was cached
    assert heard == [
        (3, 12, "prefill"),
        (6, 12, "prefill"),
        (9, 12, "prefill"),
        (12, 12, "prefill"),
    ]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 3}])
async def test_each_token_carries_its_text_and_its_positions_likeliest_tokens(sampling):
    async with Engine.open(config()) as engine:
        result = await engine.generate(PROMPT, max_new_tokens=NEW, top_logprobs=4, **sampling)
        plain = await engine.generate(PROMPT, max_new_tokens=NEW, **sampling)
    assert "".join(result.pieces) == result.text
    assert result.tokens == plain.tokens and all(top == () for top in plain.top_logprobs)
    for token, logprob, top in zip(
        result.tokens, result.logprobs, result.top_logprobs, strict=True
    ):
        assert len(top) == 4 and [t.logprob for t in top] == sorted(
            (t.logprob for t in top), reverse=True
        )
        assert logprob <= top[0].logprob
        if not sampling:  # greedy: the token is its position's likeliest
            assert (top[0].token, top[0].logprob) == (token, logprob)
    with pytest.raises(ConfigError, match="top_logprobs = 21: expected 0 to 20"):
        generation_options(top_logprobs=21)
