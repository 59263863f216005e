"""An engine's start: the draft, then the target under the memory plan, the policies, the
context and the prefix cache, in that order so that each is planned for what the ones
before it hold (a fixed budget with room to spare reads the target's resident weights
beside the draft's load). A memory limit that cannot hold them is refused before anything
loads."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
import trio

from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.config import EngineConfig
from lever_actors.device.budget import ResidencyPlan
from lever_actors.device.flash import FlashStore
from lever_actors.device.manifest import Manifest
from lever_actors.device.memory import anonymous_rss_bytes, map_large_blocks, return_freed_heap
from lever_actors.device.units import ComputeUnit
from lever_actors.draft import DraftModel, load_draft
from lever_actors.engine.prefix_cache import PrefixCache, open_prefix_cache
from lever_actors.errors import ConfigError
from lever_actors.model.transformer import Transformer
from lever_actors.plan.start import Proposal, StartPlan, finish, plan_memory_after_draft
from lever_actors.policy.setup import Policies, build_policies
from lever_actors.progress import Progress
from lever_actors.target import FlashTarget, Resident, read_resident


class LoadTimes(msgspec.Struct, frozen=True):
    """Where an engine's start went, in seconds (`Engine.load_times`)."""

    draft: float  # loading the draft (a snapshot's read, or a GGUF's conversion)
    target: float  # opening the layout and reading its resident weights
    policies: float  # the cost model's start (measured once per machine), the predictor
    beside: bool = False  # the target's weights were read beside the draft's load

    def __str__(self) -> str:
        where = " beside the draft" if self.beside else ""
        return (
            f"draft {self.draft:.1f} s, target {self.target:.1f} s{where}, "
            f"policies {self.policies:.1f} s"
        )


@dataclass
class Loaded:
    """What an engine serves with, as `load` left it."""

    target: FlashTarget
    draft: Transformer | None  # proposing from config.draft_vocabulary's ids; the engine takes it
    policies: Policies
    prefixes: PrefixCache
    times: LoadTimes
    plan: StartPlan


@asynccontextmanager
async def load(
    manifest: Manifest,
    proposal: Proposal,
    draft: DraftModel | None,
    npu: ComputeUnit,
    progress: Progress | None,
) -> AsyncIterator[Loaded]:
    """Load what the proposal's config names (or use `draft`, already loaded) on `npu`'s
    thread, making the rest of the start-up plan as each part becomes known (plan/start.py);
    the target is closed when the block ends."""
    started = time.perf_counter()
    config = proposal.config
    drafting = config.tree.needs_draft
    before_draft = anonymous_rss_bytes()
    loading_draft = draft is None and drafting
    early = proposal.beside_draft
    resident: list[Resident] = []  # the target's extents, where they are read beside the draft
    reads: list[float] = []  # and the seconds that took
    # the draft first: its loading peak (several hundred MB of temporaries) then comes
    # before the target's resident weights, not on top of them; but where the budget is
    # fixed and the limit holds both with room to spare, the target's reads run beside it
    async with trio.open_nursery() as nursery:
        if early is not None:
            nursery.start_soon(_read_beside, config, early, resident, reads)
        if loading_draft:
            draft = await npu.run(
                load_draft,
                config.draft,
                config.draft_dtype,
                config.draft_weights,
                config.draft_vocabulary,
            )
            return_freed_heap()  # the load's temporaries, before the plan counts what it holds
        draft_loaded = time.perf_counter()
    drafted = draft.model if draft is not None and drafting else None
    memory, residency = plan_memory_after_draft(config, manifest, before_draft, early, drafted)
    if residency.streams:
        map_large_blocks()  # short of memory: a step's temporaries go back as they are freed
    target = await npu.run(_open_target, config, residency, resident[0] if resident else None)
    target_opened = time.perf_counter()
    try:
        model = None
        if draft is not None and drafting:
            _check_same_vocabulary(target, draft)
            model = draft.model.proposing(config.draft_vocabulary)
        policies = await npu.run(build_policies, config, target, model, progress)
        return_freed_heap()  # the start-up profiling's temporaries
        plan = finish(config, proposal.decode, memory, target, model)
        prefixes = await npu.run(open_prefix_cache, config, plan.context, target, model)
        times = LoadTimes(
            draft=draft_loaded - started,
            target=target_opened - draft_loaded + sum(reads),
            policies=time.perf_counter() - target_opened,
            beside=bool(resident),
        )
        loaded = Loaded(target, model, policies, prefixes, times, plan)
        # the engine alone holds the draft from here: it may let go of it (engine/switching.py)
        draft = drafted = model = None
        yield loaded
    finally:
        target.close()


async def _read_beside(
    config: EngineConfig, plan: ResidencyPlan, into: list[Resident], seconds: list[float]
) -> None:
    """The resident extents of `plan` read on a worker thread (reads and checksums only, no
    torch computation to start a second OpenMP team), into `into`; the time, into `seconds`."""
    started = time.perf_counter()
    into.append(await trio.to_thread.run_sync(_read_resident, config, plan))
    seconds.append(time.perf_counter() - started)


def _read_resident(config: EngineConfig, plan: ResidencyPlan) -> Resident:
    store = FlashStore(
        Path(config.target), throttle=config.throttle, verify=config.verify_checksums
    )
    try:
        return read_resident(store, plan)
    finally:
        store.close()


def _open_target(
    config: EngineConfig, plan: ResidencyPlan, resident: Resident | None
) -> FlashTarget:
    return FlashTarget(
        Path(config.target),
        plan,
        throttle=config.throttle,
        verify=config.verify_checksums,
        resident=resident,
    )


def _check_same_vocabulary(target: FlashTarget, draft: DraftModel) -> None:
    """The target verifies the draft's token ids: both models must have as many tokens and,
    where both tokenizers are known, spell each id the same (one parsed vocabulary, from
    files of the same bytes, does)."""
    sizes = draft.model.args.vocab_size, target.args.vocab_size
    difference = ""  # compared where both tokenizers are known
    ours, theirs = draft.tokenizer, target.tokenizer
    if ours is not None and theirs is not None and ours.backend is not theirs.backend:
        difference = _first_difference(ours, theirs)
    if sizes[0] != sizes[1] or difference:
        raise ConfigError(
            f"draft {draft.source} has {sizes[0]} tokens, the target {sizes[1]}{difference}: "
            "speculative decoding needs the same tokenizer"
        )


def _first_difference(draft: Tokenizer, target: Tokenizer) -> str:
    """'; first difference at id N: ...' for the lowest id the two spell differently, or
    that only one has; empty when they agree. Id by id: no copy of either vocabulary (two
    dicts of 150k tokens would cost 80 MB at start-up)."""
    ids = max(t.backend.get_vocab_size(with_added_tokens=True) for t in (draft, target))
    for i in range(ids):
        ours, theirs = draft.backend.id_to_token(i), target.backend.id_to_token(i)
        if ours != theirs:
            return (
                f"; first difference at id {i}: {_spelled(ours)} in the draft, "
                f"{_spelled(theirs)} in the target"
            )
    return ""


def _spelled(token: str | None) -> str:
    return "no token" if token is None else repr(token)
