"""The context an engine serves: the model's, what ctx_size asks, or what the memory left
after loading holds; a request beyond it is refused before any work, with its sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from lever_actors.config import EngineConfig
from lever_actors.device import memory as device_memory
from lever_actors.device.manifest import read_manifest
from lever_actors.device.memory import (
    charged_file_bytes,
    file_rss_bytes,
    memory_limit_bytes,
)
from lever_actors.engine import Engine
from lever_actors.errors import ConfigError, ContextLengthError
from lever_actors.model.shapes import position_bytes
from lever_actors.plan import memory as memory_module
from lever_actors.plan.context import KV_SHARE, POOL_SHARE, TEMPORARY_BYTES, plan_context
from lever_actors.testing import TINY_ARGS, model_pair

MiB = 2**20


def test_the_context_is_the_models_what_was_asked_or_what_the_memory_holds():
    roomy = plan_context(None, 32768, 40 * 1024, limit=24 << 30, held=1 << 30)
    assert roomy.tokens == 32768 and "the model's" in str(roomy)
    tight = plan_context(None, 32768, 40 * 1024, limit=1 << 30, held=(1 << 30) - 100 * MiB)
    assert TEMPORARY_BYTES == 32 * MiB  # a step's, kept apart from the KV's share
    assert tight.tokens == int(68 * MiB * KV_SHARE) // (40 * 1024)  # 870
    assert "what 100.0 MiB free of 1.00 GiB holds" in str(tight)
    assert "set ctx_size for more" in tight.why
    asked = plan_context(4096, 32768, 40 * 1024, limit=1 << 30, held=(1 << 30) - 100 * MiB)
    assert asked.tokens == 4096 and asked.why == "ctx_size"
    with pytest.raises(ConfigError, match="ctx_size 40,000 exceeds the model's context of 32,768"):
        plan_context(40000, 32768, 1, limit=1 << 40, held=0)


def fake_system(tmp_path: Path, cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    for name, text in files.items():
        (cgroups / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroups / name).write_text(text)
    return proc, cgroups


def test_the_memory_limit_is_the_tightest_cgroup_limit_above_us(tmp_path, monkeypatch):
    # our anonymous RSS held still: the process's own moves by a page between two reads
    monkeypatch.setattr(device_memory, "anonymous_rss_bytes", lambda: 300 * MiB)
    v2 = fake_system(
        tmp_path / "v2",
        "0::/user/app\n",
        {"user/memory.max": f"{600 * MiB}\n", "user/app/memory.max": "max\n"},
    )
    assert memory_limit_bytes(*v2) == 600 * MiB
    v1 = fake_system(
        tmp_path / "v1",
        "4:memory:/box\n1:cpu:/\n",
        {"memory/box/memory.limit_in_bytes": f"{900 * MiB}\n"},
    )
    assert memory_limit_bytes(*v1) == 900 * MiB
    free = fake_system(tmp_path / "none", "0::/\n", {})
    assert memory_limit_bytes(*free) == 4000000 * 1024 + 300 * MiB


def test_libraries_count_only_as_far_as_the_binding_limit_is_charged_for_them(
    tmp_path, monkeypatch
):
    """A page stays charged to the cgroup that read it first: libraries another process
    loaded cost this limit nothing, and the plan gives their memory to the weights."""
    v1 = fake_system(
        tmp_path / "v1",
        "4:memory:/box\n",
        {
            "memory/box/memory.limit_in_bytes": f"{900 * MiB}\n",
            "memory/box/memory.stat": f"mapped_file 0\ntotal_mapped_file {MiB}\n",
        },
    )
    assert file_rss_bytes() > MiB  # this process's libraries
    # held still from here: the process's own pages move between two reads
    monkeypatch.setattr(device_memory, "file_rss_bytes", lambda: 200 * MiB)
    assert charged_file_bytes(*v1) == MiB
    v2 = fake_system(
        tmp_path / "v2",
        "0::/app\n",
        {"app/memory.max": f"{600 * MiB}\n", "app/memory.stat": "anon 5\nfile_mapped 4096\n"},
    )
    assert charged_file_bytes(*v2) == 4096
    # no limit, or one looser than what the machine has free: every mapped page counts
    assert charged_file_bytes(*fake_system(tmp_path / "none", "0::/\n", {})) == 200 * MiB


@pytest.fixture(scope="module")
def config() -> EngineConfig:
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    return EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="chain:2")


async def test_a_request_beyond_ctx_size_is_refused_with_its_sizes(config):
    async with Engine.open(EngineConfig(**{**_fields(config), "ctx_size": 12})) as engine:
        assert engine.context.tokens == 12
        assert len((await engine.generate([1, 2, 3], max_new_tokens=9)).tokens) == 9
        with pytest.raises(ContextLengthError) as refused:
            await engine.generate([1, 2, 3, 4], max_new_tokens=9)
    assert (refused.value.prompt_tokens, refused.value.context_tokens) == (4, 12)
    assert str(refused.value) == (
        "prompt (4 tokens) + max_new_tokens (9) exceeds the context of 12 tokens (ctx_size)"
    )


@pytest.mark.parametrize("libraries", [0, 3 * MiB])
async def test_a_context_the_memory_bounds_says_so(config, monkeypatch, libraries):
    # bytes left after loading: a step's temporaries and some context beside the tiny
    # weights (counted as planned: a ring slot is touched by its first pass) and the
    # libraries' pages the limit charges (left out, 4 at once under 1 GiB were killed)
    room = TEMPORARY_BYTES + 100_000
    weights = read_manifest(Path(config.target)).file_bytes
    monkeypatch.setattr(memory_module, "anonymous_rss_bytes", lambda: 0)
    monkeypatch.setattr(memory_module, "charged_file_bytes", lambda: libraries)
    monkeypatch.setattr(memory_module, "memory_limit_bytes", lambda: room + weights + libraries)
    fixed = EngineConfig(**{**_fields(config), "dram_budget": "all"})  # auto keeps room
    async with Engine.open(fixed) as engine:
        target, draft = engine.target, engine.draft
        assert draft is not None
        per_token = position_bytes(target.args, target.dtype.itemsize) + position_bytes(
            draft.args, draft.dtype.itemsize
        )
        assert engine.context.kv_bytes_per_token == per_token
        assert engine.context.tokens == int((room - TEMPORARY_BYTES) * KV_SHARE) // per_token
        pool = int((room - TEMPORARY_BYTES) * POOL_SHARE) // per_token  # requests' and cache's
        assert engine.context.room_tokens == pool
        assert engine.prefixes.capacity_bytes == pool * per_token
        with pytest.raises(
            ContextLengthError, match=r"left of a .* memory limit holds; set ctx_size for more"
        ):
            await engine.generate([1, 2, 3], max_new_tokens=engine.context.tokens)


def _fields(config: EngineConfig) -> dict:
    return {f: getattr(config, f) for f in config.__struct_fields__}


async def test_a_text_too_long_for_the_context_is_refused_from_its_length(monkeypatch):
    pair = model_pair(TINY_ARGS, "identical", 0, tokenizer="words")
    config = EngineConfig(target=str(pair.target), ctx_size=64)
    encoded: list[int] = []
    async with Engine.open(config) as engine:
        tokenizer = engine.tokenizer
        assert tokenizer is not None
        encode = tokenizer.encode
        monkeypatch.setattr(tokenizer, "encode", lambda text: encoded.append(1) or encode(text))
        with pytest.raises(ContextLengthError, match=r"prompt \(at least \d+ tokens: 40,000 char"):
            await engine.generate("t1" * 20_000, max_new_tokens=4)
        assert encoded == []  # refused before tokenizing
        fits = "t1 " * 30  # longer in bytes than the room, shorter in tokens
        assert len((await engine.generate(fits, max_new_tokens=4)).tokens) == 4
        assert encoded == [1]
        # whitespace the tokenizer drops: the length's bound passes the room, the tokens not
        room, gap = 60, 1
        while tokenizer.fewest_tokens(spaced := ("t1" + " " * gap) * 30) <= room:
            gap += 1
        assert tokenizer.fewest_tokens(spaced) <= 2 * room and len(encode(spaced)) <= room
        assert len((await engine.generate(spaced, max_new_tokens=4)).tokens) == 4


async def test_a_ctx_size_beyond_the_models_names_it_before_the_memory_is_planned(
    config, monkeypatch
):
    # a limit that holds nothing would be refused too: the model's context is said first
    monkeypatch.setattr(memory_module, "memory_limit_bytes", lambda: 64 << 20)
    huge = EngineConfig(**{**_fields(config), "ctx_size": 1_000_000, "plan": "auto"})
    model = r"^ctx_size 1,000,000 exceeds the model's context of 256 tokens$"
    with pytest.raises(ConfigError, match=model):
        async with Engine.open(huge):
            pass
