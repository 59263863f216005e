"""The start-up plan, made once as the engine loads, each part when what it depends on is
known: before the draft loads, how tokens are proposed (decode.py) and a limit that cannot
hold it refused; after the draft, the memory plan and the target's residency; after the
target and the policies, the context and how many requests decode at once. The engine
keeps the whole (`Engine.plan`); nothing else plans."""

from __future__ import annotations

from pathlib import Path

import msgspec

from lever_actors.config import DramBudget, EngineConfig
from lever_actors.device.budget import ResidencyPlan, plan_residency
from lever_actors.device.layout import Manifest
from lever_actors.errors import ConfigError
from lever_actors.model.kv_cache import position_bytes
from lever_actors.model.transformer import Transformer
from lever_actors.paths import path_bytes
from lever_actors.plan.context import Context, kv_bytes_per_token, plan_context
from lever_actors.plan.decode import DecodePlan, choose_plan
from lever_actors.plan.memory import AUTO_CONTEXT, MemoryPlan, memory_plan, read_process
from lever_actors.plan.parallel import parallel_of
from lever_actors.target import FlashTarget

AUTO = DramBudget("auto")


class StartPlan(msgspec.Struct, frozen=True):
    """What the engine decided at start, from the machine and the memory it may use."""

    decode: DecodePlan  # how tokens are proposed, and why
    memory: MemoryPlan  # how the memory the process may use was shared out
    residency: ResidencyPlan  # the target's layers held in DRAM and those streamed
    context: Context  # how many tokens a request may fill, and why
    parallel: int  # requests that may decode at once

    def __str__(self) -> str:
        return f"{self.memory}\n{self.decode}"


def check_room(config: EngineConfig, manifest: Manifest, loading_draft: bool) -> None:
    """A limit that cannot hold the draft's file (its weights take no more) beside the
    process and the target's least budget is refused now, before what would not fit is
    parsed or loaded; the budget itself is planned once the draft is in."""
    draft_file = path_bytes(Path(config.draft)) if loading_draft and config.draft else 0
    memory_plan(config, manifest, read_process(), draft=draft_file, context_tokens=0, budget=AUTO)


def propose(
    config: EngineConfig, manifest: Manifest, draft_loaded: bool
) -> tuple[EngineConfig, DecodePlan]:
    """Before the draft loads: the config to load and the plan it decodes by (blocking where
    `plan` is auto), refused where the limit cannot hold its draft."""
    config, decode = choose_plan(config, manifest, draft_loaded)
    check_room(config, manifest, loading_draft=config.tree.needs_draft and not draft_loaded)
    return config, decode


def residency_beside_draft(config: EngineConfig, manifest: Manifest) -> ResidencyPlan | None:
    """The target's residency before the draft loads, where it does not depend on what the
    draft will hold: a fixed budget that the limit holds beside the draft's whole file (its
    load takes no more) with room for AUTO_CONTEXT's tokens to spare; else None."""
    if config.dram_budget.kind == "auto" or not config.draft:
        return None
    try:
        draft_file = path_bytes(Path(config.draft))
        memory = memory_plan(config, manifest, read_process(), draft=draft_file)
    except ConfigError:
        return None  # the plan made after the draft's load says why
    if memory.context_tokens < AUTO_CONTEXT:
        return None
    return plan_residency(manifest, memory.budget, config.ring_slots)


def plan_memory_after_draft(
    config: EngineConfig,
    manifest: Manifest,
    before_draft: int,
    beside: ResidencyPlan | None,
    draft: Transformer | None,
) -> tuple[MemoryPlan, ResidencyPlan]:
    """Once the draft is in: the memory plan, beside what the process held before it
    (`before_draft` bytes) and what the draft's load added, less the target's weights read
    beside it (`beside`, whose residency stands); and the target's residency under it."""
    reading = read_process()
    read_beside = sum(manifest.extent(key).nbytes for key in beside.resident) if beside else 0
    memory = memory_plan(
        config,
        manifest,
        msgspec.structs.replace(reading, process=before_draft),
        draft=reading.process - before_draft - read_beside,
        draft_kv_bytes_per_token=position_bytes(draft.args, draft.dtype) if draft else 0,
    )
    return memory, beside or plan_residency(manifest, memory.budget, config.ring_slots)


def finish(
    config: EngineConfig,
    decode: DecodePlan,
    memory: MemoryPlan,
    target: FlashTarget,
    draft: Transformer | None,
) -> StartPlan:
    """Once the target and the policies are in: the context the memory left holds, and how
    many requests may decode at once in it."""
    reading = read_process()
    context = plan_context(
        config.ctx_size,
        target.args.max_seq_len,
        kv_bytes_per_token(target, draft),
        reading.limit,
        reading.process,
    )
    return StartPlan(decode, memory, target.plan, context, parallel_of(config, context))
