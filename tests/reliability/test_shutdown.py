"""A shutdown no client can hold (#64, E6): hypercorn shields its writes, so a client that
reads nothing could keep SIGTERM's or Ctrl-C's shutdown waiting for ever; once the grace
and then CLOSE_SECONDS (past hypercorn's own graceful timeout) have passed, the process
exits anyway, saying why."""

from __future__ import annotations

import os
import signal
import threading
from functools import partial

import pytest
import trio

import lever_actors.serve as serving
from lever_actors.config import EngineConfig
from lever_actors.serve import ShutdownDeadline, serve
from lever_actors.serve.options import ServeOptions
from lever_actors.testing import TINY_ARGS, model_pair

WAIT = 10.0


def test_an_armed_deadline_exits_with_its_code_and_says_why(caplog):
    exited: list[int] = []
    done = threading.Event()

    def exit(code: int) -> None:
        exited.append(code)
        done.set()

    with ShutdownDeadline(exit) as deadline:
        deadline.arm(0.05, 130)
        deadline.arm(60, 0)  # the first arming holds
        assert done.wait(WAIT)
    assert exited == [130]
    assert "a client still held its connection 0.05 s into the shutdown; exiting" in caplog.text


def test_a_deadline_disarmed_by_a_server_that_returned_never_exits():
    exited: list[int] = []
    with ShutdownDeadline(exited.append) as deadline:
        deadline.arm(0.05, 0)
    threading.Event().wait(0.2)
    assert exited == []


@pytest.fixture(scope="module")
def config() -> EngineConfig:
    pair = model_pair(TINY_ARGS, "perturbed", 0, tokenizer="words")
    return EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="chain:2")


async def test_sigterm_arms_the_deadline_past_the_grace_and_a_clean_return_disarms_it(
    config, monkeypatch
):
    armed: list[tuple[float, int]] = []
    exited: list[int] = []

    class Recorded(ShutdownDeadline):
        def __init__(self) -> None:
            super().__init__(exited.append)

        def arm(self, seconds: float, code: int) -> None:
            armed.append((seconds, code))
            super().arm(seconds, code)

    monkeypatch.setattr(serving, "ShutdownDeadline", Recorded)
    monkeypatch.setattr(serving, "CLOSE_SECONDS", 0.5)
    options = ServeOptions(port=0, grace=0.25)
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:  # ends when serve returns by itself
            await nursery.start(partial(serve, config, options, drain_on=(signal.SIGTERM,)))
            os.kill(os.getpid(), signal.SIGTERM)
    await trio.sleep(0.25 + 0.5 + 0.5)  # past when an armed deadline would fire
    assert armed == [(0.25 + 0.5, 0)]
    assert exited == []
