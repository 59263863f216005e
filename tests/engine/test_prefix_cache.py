"""The prefix cache: a request that starts with an earlier request's text reuses its KV and
emits exactly what a cold start emits (float64 and bf16, greedy and seeded sampling); the
LRU keeps the longest prefixes it has room for."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lever_actors.config import EngineConfig
from lever_actors.engine import Engine
from lever_actors.engine.prefix_cache import PrefixCache
from lever_actors.engine.state import draft_view
from lever_actors.errors import ConfigError
from lever_actors.model.kv_cache import KVCache
from lever_actors.testing import bf16_engine_cases, engine_cases, reference_tokens, samplings
from lever_actors.testing.checkpoints import TINY_ARGS, model_pair


def examples(share: float) -> settings:
    return settings(max_examples=max(1, round(settings.default.max_examples * share)))


async def conversation(config: EngineConfig, turns: list[list[int]], n: int, sampling=None):
    """Each turn's prompt is the text so far (the last prompt and its reply) plus the turn's
    new tokens; -> each turn's (prompt, result)."""
    text: list[int] = []
    done = []
    keywords = {} if sampling is None else msgspec.structs.asdict(sampling)
    async with Engine.open(config) as engine:
        for extra in turns:
            prompt = [*text, *extra]
            result = await engine.generate(prompt, max_new_tokens=n, **keywords)
            done.append((prompt, result))
            text = [*prompt, *result.tokens]
    return done


# the new tokens of one to two later turns
turns = st.lists(
    st.lists(st.integers(0, TINY_ARGS.vocab_size - 1), min_size=1, max_size=5),
    min_size=1,
    max_size=2,
)


@examples(0.3)
@given(case=engine_cases(), later=turns)
async def test_a_conversation_reusing_its_prefix_equals_cold_starts(case, later):
    config = case.engine_config()
    done = await conversation(config, [case.prompt, *later], case.max_new_tokens)
    for prompt, result in done:
        expected = reference_tokens(config.target, prompt, case.max_new_tokens)
        assert result.tokens == expected, f"prompt {prompt}, cached {result.cached_tokens}"
    for (before, _), (prompt, result) in zip(done, done[1:], strict=False):
        assert result.cached_tokens >= min(len(before), len(prompt) - 1)


@examples(0.2)
@given(case=engine_cases(sampling=samplings()), more=turns)
async def test_seeded_sampling_with_a_reused_prefix_equals_sequential_sampling(case, more):
    config = case.engine_config()
    done = await conversation(config, [case.prompt, *more], case.max_new_tokens, case.sampling)
    for prompt, result in done:
        expected = reference_tokens(
            config.target, prompt, case.max_new_tokens, sampling=case.sampling
        )
        assert result.tokens == expected, f"prompt {prompt}, cached {result.cached_tokens}"


@settings(max_examples=max(1, settings.default.max_examples // 20))
@given(case=bf16_engine_cases(), extra=st.lists(st.integers(0, 63), min_size=1, max_size=4))
async def test_a_reused_prefix_in_bf16_equals_sequential_decoding_in_bf16(case, extra):
    config = case.engine_config()
    done = await conversation(config, [case.prompt, extra], case.max_new_tokens)
    for prompt, result in done:
        expected = reference_tokens(config.target, prompt, case.max_new_tokens)
        assert result.tokens == expected, f"prompt {prompt}, cached {result.cached_tokens}"
    assert done[1][1].cached_tokens >= len(case.prompt)


@examples(0.1)
@given(case=engine_cases(new_tokens=st.integers(4, 12)), cut=st.integers(1, 3))
async def test_a_branch_reuses_the_shared_part_and_keeps_the_other_branch(case, cut):
    """Two requests that share only a beginning: the second reuses that much, and the first
    one's text stays cached for a third request that continues it."""
    config = case.engine_config()
    first = case.prompt
    async with Engine.open(config) as engine:
        one = await engine.generate(first, max_new_tokens=case.max_new_tokens)
        branch = [*first[: max(1, len(first) - cut)], (first[-1] + 1) % 32, 5]
        two = await engine.generate(branch, max_new_tokens=case.max_new_tokens)
        again = await engine.generate([*first, *one.tokens, 7], max_new_tokens=2)
        entries = len(engine.prefixes)
    stored = [*first, *one.tokens]  # the first request's text, which the cache holds
    shared = 0  # up to the branch's last token, whose pass gives the first new one
    while shared < min(len(stored), len(branch) - 1) and stored[shared] == branch[shared]:
        shared += 1
    assert two.cached_tokens == shared
    assert two.tokens == reference_tokens(config.target, branch, case.max_new_tokens)
    assert again.cached_tokens >= len(first)
    assert again.tokens == reference_tokens(config.target, [*first, *one.tokens, 7], 2)
    assert entries == 2  # the branch's and the continued text's


async def test_no_prompt_cache_reuses_nothing():
    config = EngineConfig(target=str(model_pair(TINY_ARGS, "identical", 0).target), prompt_cache=0)
    async with Engine.open(config) as engine:
        first = await engine.generate([1, 2, 3], max_new_tokens=4)
        second = await engine.generate([1, 2, 3, *first.tokens, 4], max_new_tokens=4)
        assert len(engine.prefixes) == 0
    assert (first.cached_tokens, second.cached_tokens) == (0, 0)


def test_prompt_cache_takes_a_size():
    assert EngineConfig(target="t", prompt_cache="1.5MiB").prompt_cache == 3 * 2**19
    with pytest.raises(ConfigError, match="prompt_cache = -1"):
        EngineConfig(target="t", prompt_cache=-1)


def cache_of(tokens: list[int]) -> KVCache:
    """A cache that holds `tokens`' positions, keys set to the token ids."""
    cache = KVCache(TINY_ARGS, len(tokens) + 4, torch.float64)
    for layer in range(TINY_ARGS.n_layers):
        k = torch.tensor(tokens, dtype=torch.float64).expand(TINY_ARGS.n_kv_heads, -1)
        k = k[..., None].expand(-1, -1, TINY_ARGS.head_dim)
        cache.write(layer, k, k)
    cache.commit(len(tokens))
    return cache


TOKEN_BYTES = cache_of([0]).prefix_bytes(1)  # a position's KV in cache_of's caches


def test_claim_takes_the_longest_shared_prefix_up_to_the_prompts_last_token():
    prefixes = PrefixCache(2**20, TOKEN_BYTES)
    prefixes.store([1, 2, 3, 4], cache_of([1, 2, 3, 4]), None)
    prefixes.store([1, 9], cache_of([1, 9]), None)
    reuse = prefixes.claim([1, 2, 3])
    assert reuse.tokens == 2  # the third token runs: its pass chooses the first new token
    restored = KVCache(TINY_ARGS, 8, torch.float64)
    reuse.restore(restored)
    assert restored.length == 2
    assert restored.keys[0, 0, :2, 0].tolist() == [1.0, 2.0]
    assert restored.positions[:2].tolist() == [0, 1]
    assert len(prefixes) == 2  # [1, 2, 3, 4] goes on beyond the prompt: it stays


def test_a_prompt_that_extends_an_entry_takes_it_out():
    prefixes = PrefixCache(2**20, TOKEN_BYTES)
    prefixes.store([1, 2], cache_of([1, 2]), None)
    assert prefixes.claim([1, 2, 3]).tokens == 2
    assert len(prefixes) == 0
    assert prefixes.claim([1, 2, 3]).tokens == 0


def test_store_keeps_what_both_caches_hold_and_drops_entries_it_extends():
    prefixes = PrefixCache(2**20, TOKEN_BYTES)
    prefixes.store([5, 6], cache_of([5, 6]), None)
    prefixes.store([5, 6, 7, 8, 9], cache_of([5, 6, 7, 8]), cache_of([5, 6, 7]))
    assert len(prefixes) == 1
    assert prefixes.claim([5, 6, 7, 8, 9, 10]).tokens == 3


def test_a_draft_viewing_the_text_from_later_on_keeps_its_part_and_continues_it():
    prefixes = PrefixCache(2**20, TOKEN_BYTES)
    text = [5, 6, 7, 8, 9, 10]
    prefixes.store(text, cache_of(text), cache_of(text[2:]), draft_start=2)
    reuse = prefixes.claim([*text, 11])
    assert (reuse.tokens, reuse.draft_start, reuse.draft_tokens) == (6, 2, 4)
    draft = KVCache(TINY_ARGS, 8, torch.float64)
    reuse.restore_draft(draft)
    assert draft.keys[0, 0, : draft.length, 0].tolist() == [7.0, 8.0, 9.0, 10.0]
    # a prompt's new tokens past the window start a fresh view; within it, the old one goes on
    assert draft_view(reuse, len(text) + 1, window=3) == 2
    assert draft_view(reuse, len(text) + 5, window=3) == len(text) + 5 - 3
    assert draft_view(reuse, len(text) + 5, window=None) == 2
    prefixes.store(text, cache_of(text), cache_of(text[2:]), draft_start=2)  # claimed whole
    before_view = prefixes.claim([5, 6, 0])  # shares only tokens the draft never saw
    assert (before_view.tokens, before_view.draft_tokens) == (2, 0)
    assert draft_view(before_view, 30, window=8) == 22
    assert draft_view(before_view, 3, window=None) == 0


async def test_a_long_prompt_is_prefilled_in_the_draft_from_its_window_alone():
    """The draft's first round runs the window's tokens, not the prompt's; the output is
    the target's, whatever the draft sees, and the next turn continues the draft's view."""
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(
        target=str(pair.target), draft=str(pair.draft), tree="chain:3", draft_window=6
    )
    prompt = [(7 * i) % TINY_ARGS.vocab_size for i in range(40)]
    async with Engine.open(config) as engine:
        first = await engine.generate(prompt, max_new_tokens=8)
        text = [*prompt, *first.tokens, 3]
        second = await engine.generate(text, max_new_tokens=8)
    assert first.steps[0].draft_rounds[0] == 6
    assert second.cached_tokens >= len(prompt)
    assert second.steps[0].draft_rounds[0] <= len(text) - second.cached_tokens + 1
    assert first.tokens == reference_tokens(config.target, prompt, 8)
    assert second.tokens == reference_tokens(config.target, text, 8)


def test_the_least_recently_used_go_first_and_a_prefix_too_large_is_not_kept():
    one = cache_of([1, 2, 3])
    size = one.prefix(3).nbytes
    prefixes = PrefixCache(2 * size, TOKEN_BYTES)
    prefixes.store([1, 2, 3], one, None)
    prefixes.store([4, 5, 6], cache_of([4, 5, 6]), None)
    prefixes.claim([1, 2, 0])  # used: [4, 5, 6] is now the least recent
    prefixes.store([7, 8, 9], cache_of([7, 8, 9]), None)
    assert prefixes.nbytes <= 2 * size
    assert prefixes.claim([4, 5, 6, 0]).tokens == 0
    assert prefixes.claim([1, 2, 3, 0]).tokens == 3
    small = PrefixCache(size - 1, TOKEN_BYTES)
    small.store([1, 2, 3], one, None)
    assert len(small) == 0


def test_the_cache_gives_way_to_the_requests_decoding():
    """The requests' KV and the prefix cache share one room: a claim or a store leaves the
    entries at most what the placed requests leave of it (`free_tokens`), the least
    recently used going first; a reuse keeps its entry's KV even where it is let go of."""
    prefixes = PrefixCache(2**20, TOKEN_BYTES)
    for text in ([1, 2, 3, 4], [5, 6, 7], [8, 9, 10]):
        prefixes.store(text, cache_of(text), None)
    assert prefixes.claim([11, 12, 13], free_tokens=6).tokens == 0
    assert len(prefixes) == 2 and prefixes.nbytes == 6 * TOKEN_BYTES  # [1, 2, 3, 4] went
    reuse = prefixes.claim([5, 6, 0], free_tokens=0)
    assert len(prefixes) == 0
    restored = KVCache(TINY_ARGS, 8, torch.float64)
    reuse.restore(restored)
    assert restored.keys[0, 0, : restored.length, 0].tolist() == [5.0, 6.0]
    prefixes.store([1, 2], cache_of([1, 2]), None)
    prefixes.store([3, 4, 5], cache_of([3, 4, 5]), None, free_tokens=3)
    assert prefixes.claim([3, 4, 5, 0]).tokens == 3 and len(prefixes) == 0  # [1, 2] went
    prefixes.store([1, 2], cache_of([1, 2]), None)
    prefixes.store([3, 4, 5], cache_of([3, 4, 5]), None, free_tokens=2)  # larger: not kept
    assert len(prefixes) == 1 and prefixes.claim([1, 2, 0]).tokens == 2


def test_a_store_makes_room_before_it_copies(monkeypatch):
    """#64 E1: a store copied a finished request's KV beside a full cache, then let the old
    entries go: for a moment the cache held one entry more than its share of the memory,
    which with two requests ending together took a server under a cgroup limit to 96%."""
    full = cache_of([1, 2, 3])
    size = full.prefix(3).nbytes
    assert full.prefix_bytes(3) == size
    prefixes = PrefixCache(size, TOKEN_BYTES)
    prefixes.store([1, 2, 3], full, None)
    held_while_copying = []
    copy = KVCache.prefix
    monkeypatch.setattr(
        KVCache, "prefix", lambda c, n: held_while_copying.append(prefixes.nbytes) or copy(c, n)
    )
    prefixes.store([4, 5, 6], cache_of([4, 5, 6]), None)
    assert held_while_copying == [0] and prefixes.nbytes == size
    assert prefixes.claim([4, 5, 6, 0]).tokens == 3
