"""Ours on the plain path (#63): the target's layout held in DRAM without torch
(plain_target.py), decoding on our plain kernels (greedy or seeded) as `generate` runs it:
one token a pass with `--plan ar` (lever-plain), copies from the text verified beside each
pass with `--plan lookup` (lever-plain-lookup) and with `auto` wherever it holds the whole
target (lever, bench/opening.py). It opens only where `generate` would
take the plain path for the same config (plan/plain.py decides), else fails with the reason;
in a child process under a memory limit, nothing it loads is torch."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import trio

from lever_actors.bench.mode import Decoded, ModeFailed, stamped
from lever_actors.bench.results import ModeInfo
from lever_actors.config import EngineConfig, check_request_size
from lever_actors.device.manifest import read_manifest
from lever_actors.errors import ConfigError
from lever_actors.model.plain_model import token_stream
from lever_actors.model.sampling import Sampling
from lever_actors.plain_target import PlainTarget
from lever_actors.plan.plain import PlainPlan, plain_context, plain_plan
from lever_actors.policy.plain_copies import CopyProposer


class PlainMode:
    """`plan`: the plain path's plan where it was made already (auto's choice)."""

    def __init__(self, info: ModeInfo, config: EngineConfig, plan: PlainPlan | None = None) -> None:
        self.info = info
        self.config = config
        self.plan = plan

    async def open(self, stack: AsyncExitStack) -> None:
        self.target = await trio.to_thread.run_sync(self._load)
        stack.callback(self.target.close)

    def _load(self) -> PlainTarget:
        manifest = read_manifest(Path(self.config.target))
        plan, why = (self.plan, "") if self.plan else plain_plan(self.config, manifest)
        if plan is None:
            raise ModeFailed(f"the plain path does not run it: {why}")
        target = PlainTarget(Path(self.config.target), embed_resident=plan.embed_resident)
        self.context = plain_context(self.config, manifest)
        self.copies = plan.copies
        self.info = msgspec.structs.replace(
            self.info,
            plan=plan.name,
            plan_auto=self.config.plan == "auto",
            budget_bytes=plan.memory.budget,
        )
        return target

    async def decode(
        self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int], sampling: Sampling
    ) -> Decoded:
        context = self.context
        try:
            check_request_size(len(prompt), max_new_tokens, context.tokens, context.why)
        except ConfigError as error:
            raise ModeFailed(str(error)) from None
        stats = self.target.reader.stats
        before = stats.bytes_read
        copies = CopyProposer(self.copies) if self.copies else None
        stream = token_stream(self.target.model, prompt, max_new_tokens, stop_ids, sampling, copies)
        decoded = await trio.to_thread.run_sync(stamped, stream)
        decoded.bytes_read = stats.bytes_read - before  # the embedding's rows, if streamed
        if copies:  # several tokens a pass
            decoded.steps = copies.passes
            decoded.first_step_tokens = copies.committed[0]
        return decoded
