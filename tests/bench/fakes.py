"""Modes on a fake clock, for the harness, the summary and the report without a model."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

from lever_actors.bench.harness import PromptSet
from lever_actors.bench.mode import Decoded
from lever_actors.bench.results import ModeInfo

SETS = [PromptSet("a", [[1, 2], [3, 4]]), PromptSet("b", [[5, 6], [7, 8]])]


def info(name: str, family: str, budget: str | None = "25%", tree: str | None = None):
    return ModeInfo(name=name, family=family, budget=budget, tree=tree)


class FakeMode:
    """Emits `rate` tokens per second on a fake clock; fails where told to."""

    def __init__(self, info: ModeInfo, rate: float, *, fail_open=None, fail_at=None, accept=1):
        self.info = info
        self.rate = rate
        self.fail_open = fail_open
        self.fail_at = fail_at
        self.accept = accept
        self.calls = 0

    async def open(self, stack: AsyncExitStack) -> None:
        if self.fail_open:
            raise self.fail_open

    async def decode(self, prompt, max_new_tokens, stop_ids, sampling) -> Decoded:
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise NotImplementedError("Cannot copy out of meta tensor; no data!")
        start = time.perf_counter() + 0.5
        tokens = [(sum(prompt) + i) % 97 for i in range(max_new_tokens)]
        stamps = [start + i / self.rate for i in range(max_new_tokens)]
        return Decoded(tokens, stamps, steps=-(-max_new_tokens // self.accept))


class BurstMode(FakeMode):
    """Its first step (with the prefill) yields `burst` tokens at once, as a tree step does."""

    def __init__(self, info: ModeInfo, rate: float, burst: int) -> None:
        super().__init__(info, rate)
        self.burst = burst

    async def decode(self, prompt, max_new_tokens, stop_ids, sampling) -> Decoded:
        decoded = await super().decode(prompt, max_new_tokens, stop_ids, sampling)
        first = decoded.stamps[0]
        decoded.stamps[: self.burst] = [first] * self.burst
        decoded.stamps[self.burst :] = [
            first + (i + 1) / self.rate for i in range(max_new_tokens - self.burst)
        ]
        decoded.first_step_tokens = self.burst
        return decoded
