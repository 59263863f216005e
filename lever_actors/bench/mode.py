"""What a decoding mode is: the Mode protocol, its Decoded output, ModeFailed. Torch-free, so
that a child process running the plain path (bench/plain_mode.py) never loads it."""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Protocol

from lever_actors.bench.results import ModeInfo
from lever_actors.model.sampling import Sampling


@dataclass
class Decoded:
    """One prompt's output; msgspec carries it between a child process and the harness."""

    tokens: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # perf_counter() as each token arrived
    bytes_read: int = 0  # from storage, while decoding this prompt
    steps: int = 0  # target passes (verification steps); 0 where a mode cannot count them
    # per token, the engine's step that gave it (empty where a mode cannot tell)
    token_steps: list[int] = field(default_factory=list)
    first_step_tokens: int = 1  # how many tokens the first step (with the prefill) produced
    peak_rss_bytes: int | None = None  # of the process that decoded, so far
    cgroup_peak_bytes: int | None = None  # of the cgroup it ran in, so far
    # figures the decoding program reported of itself (llama.cpp's timings, command line)
    reported: dict[str, float | int | str] | None = None

    def add(self, token: int) -> None:
        self.tokens.append(token)
        self.stamps.append(time.perf_counter())


class Mode(Protocol):
    info: ModeInfo  # info.name names the mode in the results

    async def open(self, stack: AsyncExitStack) -> None:
        """Load what the mode needs; anything to close goes on `stack`."""

    async def decode(
        self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int], sampling: Sampling
    ) -> Decoded: ...


class ModeFailed(Exception):
    """A mode could not open or decode; the harness reports the row as failed with this text."""


def describe(error: BaseException) -> str:
    """An error as the results show it: a ModeFailed's own text, else its type and message;
    cut to 500 characters."""
    text = str(error) if isinstance(error, ModeFailed) else f"{type(error).__name__}: {error}"
    return text if len(text) <= 500 else text[:497] + "..."


def stamped(tokens: Iterable[int]) -> Decoded:
    decoded = Decoded()
    for token in tokens:
        decoded.add(token)
    decoded.steps = len(decoded.tokens)  # one target pass per token
    return decoded
