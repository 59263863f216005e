"""A GGUF as it is (#66, item 4): `EngineConfig(target="model.gguf")` and `generate --target
model.gguf` convert it once into the cache, then answer as its converted layout does; an
edited file converts anew."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from lever_actors import Engine, EngineConfig
from lever_actors.checkpoints import gguf_layout
from lever_actors.checkpoints.convert import convert
from lever_actors.cli import main
from tests.reliability.tiny import gguf_metadata, gguf_tensors, write_gguf

PROMPT = "abcab"
NEW = 6


@pytest.fixture
def conversions(monkeypatch, tmp_path) -> list[Path]:
    """The layouts converted into the cache (the cache a fresh one under tmp_path)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    made: list[Path] = []

    def counted(source, out, *args, **kwargs):
        made.append(out)
        return convert(source, out, *args, **kwargs)

    monkeypatch.setattr(gguf_layout, "convert", counted)
    return made


async def text_of(target: Path | str) -> str:
    config = EngineConfig(target=str(target), plan="ar")
    async with Engine.open(config) as engine:
        return (await engine.generate(PROMPT, max_new_tokens=NEW)).text


async def test_a_gguf_target_converts_once_and_answers_as_its_layout(tmp_path, conversions):
    model = write_gguf(tmp_path / "tiny.gguf", gguf_metadata(), gguf_tensors())
    layout = tmp_path / "layout"
    convert(model, layout, torch.bfloat16, None, "auto")
    expected = await text_of(layout)
    assert await text_of(model) == expected
    assert await text_of(model) == expected
    assert len(conversions) == 1 and conversions[0].is_relative_to(tmp_path / "cache")
    os.utime(model, ns=(0, 0))  # the file changed: its identity, and with it its layout
    assert await text_of(model) == expected
    assert len(conversions) == 2


def test_generate_takes_a_gguf_target_as_it_is(tmp_path, conversions, capsys):
    model = write_gguf(tmp_path / "tiny.gguf", gguf_metadata(), gguf_tensors())
    flags = ["--target", str(model), "--plan", "ar", "--prompt", PROMPT]
    for _ in range(2):
        assert main(["generate", *flags, "--max-new-tokens", str(NEW)]) == 0
    first, second = capsys.readouterr().out.splitlines()[-2:]
    assert first and first == second and len(conversions) == 1


def test_a_conversion_runs_on_a_thread_that_ends_before_the_engine_opens(tmp_path, monkeypatch):
    # a torch team left on the caller's thread would sleep the engine's between products
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ran_on: list[threading.Thread] = []

    def recorded(*args, **kwargs):
        ran_on.append(threading.current_thread())
        return convert(*args, **kwargs)

    monkeypatch.setattr(gguf_layout, "convert", recorded)
    model = write_gguf(tmp_path / "tiny.gguf", gguf_metadata(), gguf_tensors())
    layout = gguf_layout.gguf_layout(model, tmp_path / "cache", None, "auto")
    assert layout.is_dir() and len(ran_on) == 1
    assert ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()
