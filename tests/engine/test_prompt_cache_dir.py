"""The prompt cache's directory: prefixes the DRAM cache lets go of, and all it holds when
the engine closes, are written there with their checksums; a later request, or a later
engine of the same weights on this machine, takes them back and emits exactly what a cold
start emits. A file that fails its checks is removed and reused by nothing."""

from __future__ import annotations

import logging

import pytest
import torch

from lever_actors.config import EngineConfig
from lever_actors.device.kv_files import SUFFIX, CachedPrefix, KVFiles, KVShape
from lever_actors.engine import Engine
from lever_actors.engine.prefix_cache import PrefixCache
from lever_actors.model.kv_cache import KVCache
from lever_actors.testing import reference_tokens
from lever_actors.testing.checkpoints import TINY_ARGS, model_pair


def cache_of(tokens: list[int], dtype: torch.dtype = torch.float64) -> KVCache:
    """A cache that holds `tokens`' positions, with random keys and values."""
    cache = KVCache(TINY_ARGS, len(tokens) + 4, dtype)
    shape = (TINY_ARGS.n_kv_heads, len(tokens), TINY_ARGS.head_dim)
    for layer in range(TINY_ARGS.n_layers):
        cache.write(layer, torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
    cache.commit(len(tokens))
    return cache


def shapes(
    dtype: torch.dtype = torch.float64, draft: bool = True
) -> tuple[KVShape, KVShape | None]:
    """The tiny target's KV and its draft's, as a file of theirs must hold them."""
    return KVShape.of(TINY_ARGS, dtype), KVShape.of(TINY_ARGS, dtype) if draft else None


def prefix_of(tokens: list[int], dtype: torch.dtype, draft: bool = True) -> CachedPrefix:
    target = cache_of(tokens, dtype).prefix(len(tokens))
    drafted = cache_of(tokens[1:], dtype).prefix(len(tokens) - 1) if draft else None
    return CachedPrefix(tuple(tokens), target, drafted, draft_start=1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_spilled_prefix_reads_back_bit_for_bit_in_a_later_directory_object(tmp_path, dtype):
    saved = prefix_of([3, 1, 4, 1, 5], dtype)
    KVFiles(tmp_path, "key", 2**30, shapes(dtype)).save(saved)
    files = KVFiles(tmp_path, "key", 2**30, shapes(dtype))  # as a later engine finds it
    assert files.longest([3, 1, 4, 9]) == ((3, 1, 4, 1, 5), 3)
    loaded = files.load((3, 1, 4, 1, 5))
    assert loaded is not None and loaded.draft is not None and saved.draft is not None
    assert (loaded.tokens, loaded.draft_start) == (saved.tokens, 1)
    for got, want in [(loaded.target, saved.target), (loaded.draft, saved.draft)]:
        for name in ("keys", "values", "positions"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert KVFiles(tmp_path, "other key", 2**30, shapes(dtype)).longest([3, 1, 4]) == (None, 0)


def test_a_file_that_fails_its_checks_is_removed_and_reused_by_nothing(tmp_path, caplog):
    files = KVFiles(tmp_path, "key", 2**30, shapes())
    files.save(prefix_of([1, 2, 3], torch.float64))
    [path] = (tmp_path / "key").glob(f"*{SUFFIX}")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a byte of the last tensor
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="lever_actors"):
        assert files.load((1, 2, 3)) is None
    assert "a checksum does not match" in caplog.text
    assert not path.exists() and files.longest([1, 2, 3, 4]) == (None, 0)
    path.write_bytes(b"\x05\x00")  # a header cut short: skipped when the directory is read
    with caplog.at_level(logging.WARNING, logger="lever_actors"):
        assert KVFiles(tmp_path, "key", 2**30, shapes()).index == {}
    assert not path.exists()


def test_a_longer_text_replaces_the_prefixes_it_extends_and_the_oldest_go_first(tmp_path):
    one = prefix_of([1, 2, 3], torch.float64, draft=False)
    files = KVFiles(tmp_path, "key", 2**30, shapes(draft=False))
    files.save(one)
    files.save(prefix_of([1, 2, 3, 4], torch.float64, draft=False))
    files.save(one)  # a longer text holds it already
    assert list(files.index) == [(1, 2, 3, 4)]
    size = files.nbytes
    small = KVFiles(tmp_path, "small", 2 * size, shapes(draft=False))
    for start in (10, 20, 30):
        small.save(prefix_of([start, 2, 3, 4], torch.float64, draft=False))
    assert sorted(small.index) == [(20, 2, 3, 4), (30, 2, 3, 4)]
    assert len(list((tmp_path / "small").glob(f"*{SUFFIX}"))) == 2


def test_the_dram_cache_spills_what_it_lets_go_of_and_claims_it_back(tmp_path):
    one = cache_of([1, 2, 3])
    size = one.prefix(3).nbytes
    prefixes = PrefixCache(
        size, one.prefix_bytes(1), KVFiles(tmp_path, "key", 2**30, shapes(draft=False))
    )
    prefixes.store([1, 2, 3], one, None)
    prefixes.store([4, 5, 6], cache_of([4, 5, 6]), None)  # [1, 2, 3] goes to the directory
    assert len(prefixes) == 1
    reuse = prefixes.claim([1, 2, 3, 7])
    assert reuse.tokens == 3 and reuse.prefix is not None
    assert torch.equal(reuse.prefix.target.keys, one.prefix(3).keys)
    larger = PrefixCache(
        1, one.prefix_bytes(1), KVFiles(tmp_path, "large", 2**30, shapes(draft=False))
    )
    larger.store([8, 9], cache_of([8, 9]), None)  # too large for DRAM: spilled alone
    assert len(larger) == 0 and larger.claim([8, 9, 1]).tokens == 2


async def test_a_later_engine_resumes_a_conversation_without_its_prefill(tmp_path):
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(
        target=str(pair.target),
        draft=str(pair.draft),
        tree="chain:3",
        prompt_cache_dir=str(tmp_path),
    )
    prompt = [(5 * i) % TINY_ARGS.vocab_size for i in range(30)]
    async with Engine.open(config) as engine:
        first = await engine.generate(prompt, max_new_tokens=6)
    assert len(list(tmp_path.glob(f"*/*{SUFFIX}"))) == 1  # written when the engine closed
    text = [*prompt, *first.tokens, 9]
    async with Engine.open(config) as engine:
        second = await engine.generate(text, max_new_tokens=6)
    assert second.cached_tokens >= len(prompt)
    assert second.tokens == reference_tokens(config.target, text, 6)
    other = model_pair(TINY_ARGS, "perturbed", 1)  # other weights: another directory
    elsewhere = EngineConfig(target=str(other.target), prompt_cache_dir=str(tmp_path))
    async with Engine.open(elsewhere) as engine:
        assert (await engine.generate(text, max_new_tokens=2)).cached_tokens == 0
