"""Our own modes on torch: memory-resident AR and the engine's pipeline, each built from its
spec (bench/specs.py)."""

from __future__ import annotations

import math
from contextlib import AsyncExitStack

import msgspec
import trio

from lever_actors.bench.mode import Decoded, stamped
from lever_actors.bench.results import ModeInfo
from lever_actors.bench.specs import EngineSpec, MemoryARSpec
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.device.layout import DTYPE_NAMES
from lever_actors.draft import DraftModel
from lever_actors.engine import Engine
from lever_actors.model.sampling import Sampling
from lever_actors.model.sequential import sequential_stream
from lever_actors.model.transformer import Transformer
from lever_actors.options import GenerationOptions


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
        decoded.token_steps = steps
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
