"""How the memory this process may use is shared out at start: what it holds (its own
anonymous memory, the draft's, its libraries' file pages), room after loading for a
context's KV, the prefix cache and a step's temporaries, and the rest for the target's
weights. `dram_budget = auto` takes that rest; a fixed budget that cannot fit beside what
is held at all is refused, before the target loads, rather than killed by the kernel
later (one that fits leaves what room it leaves: the bench's fixed budgets run so)."""

from __future__ import annotations

import msgspec

from lever_actors.config import DramBudget, EngineConfig
from lever_actors.device.budget import minimum_budget
from lever_actors.device.manifest import DTYPE_SIZES, Manifest
from lever_actors.device.memory import (
    anonymous_rss_bytes,
    charged_file_bytes,
    memory_limit_bytes,
)
from lever_actors.errors import ConfigError
from lever_actors.model.shapes import position_bytes
from lever_actors.plan.context import room_bytes, tokens_in
from lever_actors.sizes import format_bytes

# the most context an auto budget keeps room for where ctx_size says none, beside the whole
# target (the real pair's 4,096 tokens of KV are 160 MiB, and room for them 320 MiB)
AUTO_CONTEXT = 4096
# where no ctx_size was asked for, auto gives the target's weights the memory beyond room
# for this many tokens: room kept for a longer context would be streamed again every step
# (under 1.25 GiB, AUTO_CONTEXT's room was 320 MiB beside a 370 MiB budget), and the context
# is measured again after loading, from what is then free (context.py)
FEWEST_AUTO_CONTEXT = 1024


class Reading(msgspec.Struct, frozen=True):
    """The process as the plans made at one moment see it: read once, shared by them all."""

    limit: int  # what the process may hold: its cgroup's limit, else free memory
    process: int  # its anonymous memory
    libraries: int  # its file pages mapped that the limit counts (charged to its cgroup)


def read_process() -> Reading:
    return Reading(memory_limit_bytes(), anonymous_rss_bytes(), charged_file_bytes())


class MemoryPlan(msgspec.Struct, frozen=True):
    """Where the memory goes, in bytes, as the engine planned it at start."""

    limit: int  # what the process may hold: its cgroup's limit, else free memory
    process: int  # anonymous memory before the models loaded (Python, torch, our modules)
    draft: int  # anonymous memory the draft's load added
    libraries: int  # file pages mapped that the limit counts: code it would page in again
    context_tokens: int  # the context the room was kept for
    room: int  # after loading: KV of context_tokens, the prefix cache, temporaries
    budget: int  # the target's weights in DRAM
    auto: bool  # chosen by the plan, not given

    def __str__(self) -> str:
        chosen = "auto" if self.auto else "given"
        return (
            f"memory: limit {format_bytes(self.limit)}; process {format_bytes(self.process)}, "
            f"draft {format_bytes(self.draft)}, libraries {format_bytes(self.libraries)}, "
            f"room for {self.context_tokens:,} tokens of context {format_bytes(self.room)}; "
            f"target budget {format_bytes(self.budget)} ({chosen})"
        )


def plan_memory(
    budget: DramBudget,
    model_bytes: int,
    least_budget: int,
    *,
    limit: int,
    process: int,
    draft: int,
    libraries: int,
    kv_bytes_per_token: int,
    context_tokens: int,
    fewest_context_tokens: int | None = None,
) -> MemoryPlan:
    """The plan for a target of `model_bytes` (at least `least_budget` in DRAM) under
    `limit`, beside what is held, with room for `context_tokens`; or, given
    `fewest_context_tokens`, an auto budget takes the whole target first where the limit
    holds it beside room for that many, and room for more only beside the whole target.
    ConfigError, naming the parts, where it cannot fit."""
    held = process + draft + libraries
    if budget.kind == "auto" and fewest_context_tokens is not None:
        beside_all = tokens_in(limit - held - model_bytes, kv_bytes_per_token)
        context_tokens = max(fewest_context_tokens, min(context_tokens, beside_all))
    room = room_bytes(kv_bytes_per_token, context_tokens)
    parts = (
        f"the process {format_bytes(process)}, the draft {format_bytes(draft)}, "
        f"its libraries {format_bytes(libraries)}"
    )
    if budget.kind == "auto":
        left = limit - held - room
        if left < least_budget:
            context = f" and room for {context_tokens:,} tokens of context ({format_bytes(room)})"
            raise ConfigError(
                f"a memory limit of {format_bytes(limit)} leaves {_spare(left)} for the "
                f"target's weights beside {parts}{context if context_tokens else ''}; the "
                f"target needs at least {format_bytes(least_budget)}: raise the limit"
                + (" or lower ctx_size" if context_tokens else "")
            )
        chosen = min(model_bytes, left)
    else:  # only what cannot fit at all is refused: the room left is the caller's choice
        chosen = budget.bytes_of(model_bytes)
        left = limit - held
        if chosen > left:
            raise ConfigError(
                f"dram_budget {budget} ({format_bytes(chosen)}) does not fit a memory limit "
                f"of {format_bytes(limit)} beside {parts}: at most {_spare(left)}, or auto, "
                "which leaves room for the context"
            )
        room = limit - held - chosen
        context_tokens = tokens_in(room, kv_bytes_per_token)  # what the rest holds
    return MemoryPlan(
        limit=limit,
        process=process,
        draft=draft,
        libraries=libraries,
        context_tokens=context_tokens,
        room=room,
        budget=chosen,
        auto=budget.kind == "auto",
    )


def _spare(left: int) -> str:
    return format_bytes(left) if left > 0 else "nothing"


def memory_plan(
    config: EngineConfig,
    manifest: Manifest,
    reading: Reading,
    *,
    draft: int,
    draft_kv_bytes_per_token: int = 0,
    context_tokens: int | None = None,
    budget: DramBudget | None = None,
) -> MemoryPlan:
    """The memory plan for this config's target, or `budget`, beside the process `reading`
    saw and `draft` bytes, with room for `context_tokens` (default: ctx_size, else
    AUTO_CONTEXT or the model's, if less)."""
    if context_tokens is None:
        context_tokens = config.ctx_size or min(AUTO_CONTEXT, manifest.args.max_seq_len)
    # without a ctx_size the target's weights come before room beyond the fewest tokens
    fewest = None if config.ctx_size else min(FEWEST_AUTO_CONTEXT, context_tokens)
    return plan_memory(
        budget or config.dram_budget,
        manifest.file_bytes,
        minimum_budget(manifest, config.ring_slots),
        limit=reading.limit,
        process=reading.process,
        draft=draft,
        libraries=reading.libraries,
        kv_bytes_per_token=position_bytes(manifest.args, DTYPE_SIZES[manifest.dtype])
        + draft_kv_bytes_per_token,
        context_tokens=context_tokens,
        fewest_context_tokens=fewest,
    )
