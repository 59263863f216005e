"""The start-up plan, made here alone as the engine loads, each part when what it depends on
is known, and the process read once at each of those moments: before the draft loads, how
tokens are proposed (decode.py, which prices each candidate under its own memory plan), a
limit that cannot hold it refused and, for a fixed budget the limit holds beside the
draft's file, the target's residency; after the draft, the memory plan (and the residency
where it was not made before); after the target and the policies, the context and how many
requests decode at once. The engine keeps the whole (`Engine.plan`)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from lever_actors.config import DramBudget, EngineConfig
from lever_actors.device.budget import ResidencyPlan, plan_residency
from lever_actors.device.manifest import Manifest
from lever_actors.errors import ConfigError
from lever_actors.model.shapes import position_bytes
from lever_actors.model.transformer import Transformer
from lever_actors.paths import path_bytes
from lever_actors.plan.context import Context, check_ctx_size, plan_context
from lever_actors.plan.decode import DecodePlan, choose_plan
from lever_actors.plan.memory import AUTO_CONTEXT, MemoryPlan, Reading, memory_plan, read_process
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


class Proposal(msgspec.Struct, frozen=True):
    """The plan before the draft loads."""

    config: EngineConfig  # as the decode plan loads it (no draft for lookup or ar)
    decode: DecodePlan
    # the target's residency, where it does not depend on what the draft will hold: its
    # weights may then be read beside the draft's load
    beside_draft: ResidencyPlan | None


def check_room(config: EngineConfig, manifest: Manifest, reading: Reading, draft: int) -> None:
    """A limit that cannot hold `draft` bytes beside the process and the target's least
    budget is refused now, before what would not fit is parsed or loaded; the budget
    itself is planned once the draft is in."""
    memory_plan(config, manifest, reading, draft=draft, context_tokens=0, budget=AUTO)


def refuse_early(config: EngineConfig, manifest: Manifest) -> None:
    """Before anything is parsed: a ctx_size beyond the model's, or a limit that cannot hold
    the process beside the target's least budget, is refused."""
    check_ctx_size(config.ctx_size, manifest.args.max_seq_len)
    check_room(config, manifest, read_process(), draft=0)


def propose(config: EngineConfig, manifest: Manifest, draft_loaded: bool) -> Proposal:
    """Before the draft loads (blocking where `plan` is auto): the config to load and the
    plan it decodes by, refused where the limit cannot hold its draft's file (its weights
    take no more)."""
    config, decode = choose_plan(config, manifest, draft_loaded)
    reading = read_process()
    loading_draft = config.tree.needs_draft and not draft_loaded
    draft_file = path_bytes(Path(config.draft)) if loading_draft and config.draft else 0
    check_room(config, manifest, reading, draft_file)
    beside = residency_beside_draft(config, manifest, reading, draft_file) if draft_file else None
    return Proposal(config, decode, beside)


def residency_beside_draft(
    config: EngineConfig, manifest: Manifest, reading: Reading, draft_file: int
) -> ResidencyPlan | None:
    """The target's residency before the draft loads, where it does not depend on what the
    draft will hold: a fixed budget that the limit holds beside the draft's whole file
    with room for AUTO_CONTEXT's tokens to spare; else None."""
    if config.dram_budget.kind == "auto":
        return None
    try:
        memory = memory_plan(config, manifest, reading, draft=draft_file)
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
        draft_kv_bytes_per_token=position_bytes(draft.args, draft.dtype.itemsize) if draft else 0,
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
    many requests may decode at once in it. What is held counts as the memory plan counted
    it where that is more than the process holds now: the target's ring slots are touched
    by its first streamed pass, not before, and the libraries' pages the limit charges come
    back when code paged out under its pressure runs (read from the process alone, 4
    requests at once under 1 GiB found 193 MiB free where 112 were, and were killed)."""
    reading = read_process()
    planned = memory.process + memory.draft + memory.budget
    context = plan_context(
        config.ctx_size,
        target.args.max_seq_len,
        kv_bytes_per_token(target, draft),
        reading.limit,
        max(reading.process, planned) + memory.libraries,
    )
    return StartPlan(decode, memory, target.plan, context, parallel_of(config, context))


def kv_bytes_per_token(target: FlashTarget, draft: Transformer | None) -> int:
    """What a token costs in a request's KV caches, target's and draft's."""
    draft_bytes = position_bytes(draft.args, draft.dtype.itemsize) if draft is not None else 0
    return position_bytes(target.args, target.dtype.itemsize) + draft_bytes
