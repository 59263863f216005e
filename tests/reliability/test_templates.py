"""Chat templates are the checkpoint's code: they render under a time limit, in any thread,
and a broken one is an error naming the checkpoint, not a traceback out of jinja2."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import tokenizers
from tokenizers import models

from lever_actors.checkpoints import tokenizer as tokenizer_module
from lever_actors.checkpoints.tokenizer import Tokenizer, user_turn
from lever_actors.errors import CheckpointError, ConfigError

LIMIT = 0.2  # seconds, for the tests: the library's 2 s would only make them slow
# 10^10 iterations of a loop that calls nothing: no sandbox hook ever runs
NESTED_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def tokenizer_with(template: str) -> Tokenizer:
    backend = tokenizers.Tokenizer(models.WordLevel({"t0": 0}, unk_token="t0"))
    return Tokenizer(
        backend, eos_ids=[], bos_id=None, chat_template=template, vocab_size=1, source="ckpt"
    )


@pytest.fixture(autouse=True)
def short_limit(monkeypatch):
    monkeypatch.setattr(tokenizer_module, "TEMPLATE_SECONDS", LIMIT)


def test_a_runaway_template_is_stopped_at_the_limit():
    before = sys.gettrace()
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=f"^ckpt: chat template took longer than {LIMIT} s$"):
        tokenizer_with(NESTED_LOOP).apply_chat_template(user_turn("hi"))
    assert time.monotonic() - started < LIMIT + 1
    assert sys.gettrace() is before  # a coverage tool's or debugger's tracer comes back


def test_a_runaway_template_is_stopped_off_the_main_thread():
    errors: list[BaseException] = []

    def render() -> None:
        try:
            tokenizer_with(NESTED_LOOP).apply_chat_template(user_turn("hi"))
        except CheckpointError as e:
            errors.append(e)

    worker = threading.Thread(target=render)
    worker.start()
    worker.join(timeout=LIMIT + 5)
    assert not worker.is_alive()
    assert "took longer than" in str(errors[0])


def test_a_template_within_the_limit_renders():
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert tokenizer_with(template).apply_chat_template(user_turn("hi")) == "<user>hi"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for m in messages %}{{ m.content }", r"^ckpt: broken chat template \(line 1\): "),
        ("{{ messages + 1 }}", "^ckpt: broken chat template: can only concatenate list"),
        ("{{ messages.nothing.here }}", "^ckpt: broken chat template: .* no attribute 'nothing'"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "^ckpt: broken chat template: "),
    ],
    ids=["syntax", "type", "undefined", "recursion"],
)
def test_a_broken_template_is_a_checkpoint_error_naming_it(template, message):
    with pytest.raises(CheckpointError, match=message):
        tokenizer_with(template).apply_chat_template(user_turn("hi"))


def test_a_template_refusing_the_conversation_is_a_config_error():
    template = "{{ raise_exception('roles must alternate user/assistant') }}"
    with pytest.raises(ConfigError, match="^chat template: roles must alternate"):
        tokenizer_with(template).apply_chat_template(user_turn("hi"))
