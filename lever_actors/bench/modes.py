"""What a decoding mode is (the Mode protocol, its Decoded output, ModeFailed), and our own
modes: memory-resident AR and the engine's pipeline. Each mode is built from its spec, plain
data that can also travel to a child process."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import trio

from lever_actors.bench.results import ModeInfo
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.config import EngineConfig
from lever_actors.device.layout import DTYPE_NAMES
from lever_actors.draft import DraftModel
from lever_actors.engine import Engine
from lever_actors.model.sampling import Sampling
from lever_actors.model.sequential import sequential_stream
from lever_actors.model.transformer import Transformer
from lever_actors.options import GenerationOptions


@dataclass
class Decoded:
    """One prompt's output; msgspec carries it between a child process and the harness."""

    tokens: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # perf_counter() as each token arrived
    bytes_read: int = 0  # from storage, while decoding this prompt
    steps: int = 0  # target passes (verification steps); 0 where a mode cannot count them
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


class MemoryARSpec(msgspec.Struct, frozen=True, tag="memory-ar"):
    target: str
    dtype: str


class MemoryAR:
    """Ours, the whole target in DRAM, KV-cached one token per pass: the memory-resident
    baseline."""

    def __init__(self, info: ModeInfo, spec: MemoryARSpec) -> None:
        self.info = info
        self.spec = spec

    async def open(self, stack: AsyncExitStack) -> None:
        self.model = await trio.to_thread.run_sync(self._load)

    def _load(self) -> Transformer:
        checkpoint = load_checkpoint(self.spec.target, DTYPE_NAMES[self.spec.dtype])
        return Transformer(checkpoint.args, checkpoint.weights)

    async def decode(
        self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int], sampling: Sampling
    ) -> Decoded:
        stream = sequential_stream(self.model, prompt, max_new_tokens, stop_ids, sampling)
        return await trio.to_thread.run_sync(stamped, stream)


class EngineSpec(msgspec.Struct, frozen=True, tag="engine"):
    config: EngineConfig


class EngineMode:
    """Ours through the actor pipeline: flash-AR (tree "none"), conventional SD, Lever.
    `draft` may pass a draft model already loaded (engine modes in one process share it)."""

    def __init__(self, info: ModeInfo, spec: EngineSpec, draft: DraftModel | None = None) -> None:
        self.info = info
        self.spec = spec
        self.draft = draft

    async def open(self, stack: AsyncExitStack) -> None:
        engine = Engine.open(self.spec.config, draft=self.draft)
        self.engine = await stack.enter_async_context(engine)
        self.info = opened_info(self.info, self.engine)

    async def decode(
        self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int], sampling: Sampling
    ) -> Decoded:
        decoded = Decoded()
        stats = self.engine.target.store.stats
        before = stats.bytes_read
        steps = []
        options = GenerationOptions(max_new_tokens=max_new_tokens, sampling=sampling)
        async for event in self.engine.stream(prompt, options=options):
            decoded.add(event.token)
            steps.append(event.step)
        decoded.bytes_read = stats.bytes_read - before
        decoded.steps = len(set(steps))
        decoded.first_step_tokens = steps.count(steps[0]) if steps else 1
        return decoded


def opened_info(info: ModeInfo, engine: Engine) -> ModeInfo:
    """`info` with what an open engine decided: its decode plan, the tok/s its cost model
    predicted for each plan (the finite ones: a results file holds nothing else), and the
    DRAM budget its memory plan gave the target."""
    plan = engine.plan.decode
    predicted = {name: rate for name, rate in plan.predicted.items() if math.isfinite(rate)}
    return msgspec.structs.replace(
        info,
        plan=plan.name,
        plan_auto=plan.auto,
        predicted_tok_s=predicted,
        budget_bytes=engine.plan.memory.budget,
    )
