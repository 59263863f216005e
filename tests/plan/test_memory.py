"""The memory plan at start: auto takes what the limit leaves beside the process, the
draft, its libraries and room for a context; a budget that cannot fit is refused in one
line naming the parts, before the target loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from lever_actors.config import DramBudget, EngineConfig
from lever_actors.engine import Engine, loading
from lever_actors.errors import ConfigError
from lever_actors.paths import path_bytes
from lever_actors.plan import memory as memory_module
from lever_actors.plan.memory import plan_memory
from lever_actors.plan.start import residency_beside_draft
from lever_actors.target import FlashTarget
from lever_actors.testing import TINY_ARGS, model_pair

MiB = 1 << 20
HELD = dict(process=160 * MiB, draft=330 * MiB, libraries=100 * MiB)


def plan(budget: str, limit: int, tokens: int = 4096, fewest: int | None = None):
    return plan_memory(
        DramBudget.parse(budget),
        1100 * MiB,
        100 * MiB,
        limit=limit,
        **HELD,
        kv_bytes_per_token=40 << 10,
        context_tokens=tokens,
        fewest_context_tokens=fewest,
    )


def test_auto_takes_what_is_left_after_the_room_for_the_context():
    # the room: a step's temporaries (32 MiB) and twice the context's KV (4,096 x 40 KiB)
    assert plan("auto", 1056 * MiB).budget == (1056 - 590 - 32 - 320) * MiB
    assert plan("auto", 3072 * MiB).budget == 1100 * MiB  # all of it fits
    assert plan("auto", 1024 * MiB, tokens=1024).budget == (1024 - 590 - 32 - 80) * MiB
    assert "target budget 114.0 MiB (auto)" in str(plan("auto", 1056 * MiB))


def test_without_a_ctx_size_auto_gives_the_target_the_memory_beyond_a_smaller_context():
    # the target streams: room for 1,024 tokens (112 MiB) only, the rest is its budget
    streams = plan("auto", 1000 * MiB, fewest=1024)
    assert (streams.context_tokens, streams.room, streams.budget) == (1024, 112 * MiB, 298 * MiB)
    # the whole target fits beside room for 2,048 tokens (1,100 + 590 + 192 MiB), not 4,096
    fits = plan("auto", (1100 + 590 + 192) * MiB, fewest=1024)
    assert (fits.context_tokens, fits.budget) == (2048, 1100 * MiB)
    assert plan("auto", 3072 * MiB, fewest=1024).context_tokens == 4096  # room for all of it
    with pytest.raises(ConfigError, match="raise the limit or lower ctx_size"):
        plan("auto", 700 * MiB)  # a ctx_size was asked for: refused, as it does not fit
    with pytest.raises(ConfigError, match="room for 1,024 tokens"):
        plan("auto", (590 + 100 + 111) * MiB, fewest=1024)  # 1,024 tokens need 112 MiB


def test_a_limit_too_small_is_refused_naming_every_part():
    with pytest.raises(ConfigError) as refused:
        plan("auto", 600 * MiB)
    assert str(refused.value) == (
        "a memory limit of 600.0 MiB leaves nothing for the target's weights beside the process "
        "160.0 MiB, the draft 330.0 MiB, its libraries 100.0 MiB and room for 4,096 tokens of "
        "context (352.0 MiB); the target needs at least 100.0 MiB: raise the limit or lower "
        "ctx_size"
    )


def test_a_fixed_budget_is_refused_only_where_it_cannot_fit_at_all():
    assert plan("338MiB", 1024 * MiB).budget == 338 * MiB  # the bench's 1.0 GiB budget runs
    with pytest.raises(ConfigError, match=r"dram_budget all \(1.07 GiB\) does not fit"):
        plan("all", 1229 * MiB)
    with pytest.raises(ConfigError, match="at most 639.0 MiB, or auto"):
        plan("1TiB", 1229 * MiB)


def test_shares_over_all_and_auto_without_an_engine_are_refused():
    with pytest.raises(ConfigError, match="a share is at most 100%"):
        DramBudget.parse("200%")
    assert EngineConfig(target="t").dram_budget == DramBudget("auto")
    with pytest.raises(ConfigError, match="auto is planned by the engine"):
        DramBudget("auto").bytes_of(100)


async def test_the_engine_plans_auto_under_a_limit_and_refuses_before_the_target_loads(
    monkeypatch,
):
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="chain:2")
    async with Engine.open(config) as engine:  # no limit to speak of: all of it
        assert engine.plan.memory.auto
        assert not engine.target.plan.streams
        held = engine.plan.memory.process + engine.plan.memory.draft + engine.plan.memory.libraries
    opened = []
    monkeypatch.setattr(FlashTarget, "__init__", lambda *a, **k: opened.append(a))
    monkeypatch.setattr(memory_module, "memory_limit_bytes", lambda: held // 2)
    with pytest.raises(ConfigError, match="the target needs at least"):
        async with Engine.open(config):
            pass
    assert opened == []


def test_before_the_draft_loads_no_room_is_asked_for():
    with pytest.raises(ConfigError) as refused:
        plan("auto", 600 * MiB, tokens=0)
    assert str(refused.value).endswith(
        "its libraries 100.0 MiB; the target needs at least 100.0 MiB: raise the limit"
    )


async def test_a_fixed_budget_with_room_to_spare_reads_the_target_beside_the_drafts_load(
    monkeypatch,
):
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    reads = []
    read = loading._read_resident
    monkeypatch.setattr(loading, "_read_resident", lambda *a: reads.append(a) or read(*a))
    texts = {}
    for budget in ("auto", "all"):
        config = EngineConfig(
            target=str(pair.target), draft=str(pair.draft), tree="chain:2", dram_budget=budget
        )
        async with Engine.open(config) as engine:
            texts[budget] = (await engine.generate([1, 2, 3], max_new_tokens=8)).tokens
        assert len(reads) == (budget == "all")  # auto plans from what the draft holds
    monkeypatch.setattr(
        memory_module, "memory_limit_bytes", lambda: engine.plan.memory.limit // 1000
    )
    draft_file = path_bytes(Path(config.draft))
    reading = memory_module.read_process()
    assert residency_beside_draft(config, engine.target.manifest, reading, draft_file) is None
    assert texts["auto"] == texts["all"]
