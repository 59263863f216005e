"""The prefix cache: the target's and the draft's KV of finished requests, kept in an LRU so
that a request that starts with the same tokens (a conversation's next turn, a shared
system prompt) prefills only the rest.

Reuse is exact: a position's keys and values are a function of the tokens up to it alone,
whichever pass computed them (the kernels are row-invariant:
tests/engine/test_prefix_cache.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lever_actors.config import SPILLED_PROMPT_CACHE, EngineConfig
from lever_actors.device.kv_files import CachedPrefix, KVFiles, KVShape, longest_shared
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.transformer import Transformer
from lever_actors.paths import cache_key
from lever_actors.plan.context import Context
from lever_actors.policy.profile_cache import weights_identity
from lever_actors.target import FlashTarget


@dataclass(frozen=True)
class Reuse:
    """What a new request starts from: its first `tokens` prompt tokens' KV, from `prefix`."""

    tokens: int
    prefix: CachedPrefix | None

    @property
    def draft_start(self) -> int:
        return self.prefix.draft_start if self.prefix is not None else 0

    @property
    def draft_tokens(self) -> int:
        """Of the reused tokens, those whose draft KV the prefix holds: from draft_start."""
        if self.prefix is None or self.prefix.draft is None:
            return 0
        return max(0, self.tokens - self.prefix.draft_start)

    def restore(self, target: KVCache) -> None:
        """Fill the target's empty cache with the reused positions."""
        if self.prefix is not None:
            target.restore(self.prefix.target, self.tokens)

    def restore_draft(self, draft: KVCache) -> None:
        """Fill the draft's empty cache with the reused positions it holds (draft_tokens)."""
        if self.draft_tokens:
            assert self.prefix is not None and self.prefix.draft is not None  # draft_tokens
            draft.restore(self.prefix.draft, self.draft_tokens)


NO_REUSE = Reuse(0, None)


class PrefixCache:
    """Prefixes of at most `capacity_bytes` in all, and at most what the requests decoding
    leave of the KV room (`free_tokens`, of `token_bytes` each: target's and draft's, as the
    batch read it when the call was made); the least recently used go first, to `spilled`
    where there is a directory for them (and all that are left at `close`)."""

    def __init__(
        self, capacity_bytes: int, token_bytes: int, spilled: KVFiles | None = None
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.token_bytes = token_bytes
        self.spilled = spilled
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def claim(self, prompt: Sequence[int], free_tokens: int | None = None) -> Reuse:
        """The entry that shares the longest prefix with `prompt`, up to its last token (whose
        pass gives the first new token), in DRAM or else spilled. An entry the prompt extends
        whole leaves DRAM: the request will store its longer text in its place. Then the
        cache gives way to the request's KV, counted in `free_tokens` (None: no request's)."""
        tokens, shared = longest_shared(self._entries, prompt[:-1])
        best = self._entries[tokens] if tokens is not None else None
        if self.spilled is not None:
            tokens, n = self.spilled.longest(prompt[:-1])
            if tokens is not None and n > shared and (loaded := self.spilled.load(tokens)):
                self._entries[loaded.tokens] = loaded
                best, shared = loaded, n
        if best is not None and shared == len(best.tokens):
            del self._entries[best.tokens]
        elif best is not None:
            self._entries.move_to_end(best.tokens)
        self._fit(self._room(free_tokens))  # the reuse holds its entry, evicted or not
        return NO_REUSE if best is None else Reuse(shared, best)

    def store(
        self,
        tokens: Sequence[int],
        target: KVCache,
        draft: KVCache | None,
        draft_start: int = 0,
        free_tokens: int | None = None,
    ) -> None:
        """Keep the KV both caches hold of `tokens`' first positions (as many as both hold;
        the draft's cache holds them from `draft_start` on), dropping entries it extends
        and then the least recently used until all fit in what the requests decoding leave
        (`free_tokens`: as claim's); a prefix larger than that is only spilled."""
        draft_end = draft_start + draft.length if draft else target.length
        length = min(target.length, draft_end, len(tokens))
        room = self._room(free_tokens)
        if length == 0 or (room == 0 and self.spilled is None):
            self._fit(room)
            return
        kept = tuple(tokens[:length])
        for old in [t for t in self._entries if kept[: len(t)] == t]:
            del self._entries[old]
        draft_length = max(0, length - draft_start)
        size = target.prefix_bytes(length) + (draft.prefix_bytes(draft_length) if draft else 0)

        def copied() -> CachedPrefix:
            drafted = draft.prefix(draft_length) if draft else None
            return CachedPrefix(kept, target.prefix(length), drafted, draft_start)

        if size > room:
            self._fit(room)
            if self.spilled is not None:
                self.spilled.save(copied())
            return
        self._fit(room - size)  # room first: the copy never lies beside a full cache
        self._entries[kept] = copied()

    def close(self) -> None:
        """Spill what DRAM holds, where there is a directory, and hold nothing."""
        if self.spilled is not None:
            for entry in self._entries.values():
                self.spilled.save(entry)
        self._entries.clear()

    def _room(self, free_tokens: int | None) -> int:
        """The bytes the entries may hold: the cache's capacity, or less where the requests
        decoding leave less of the KV room."""
        if free_tokens is None:
            return self.capacity_bytes
        return min(self.capacity_bytes, free_tokens * self.token_bytes)

    def _fit(self, capacity: int) -> None:
        """Let the least recently used go until the entries hold at most `capacity` bytes."""
        while self.nbytes > capacity:
            _, entry = self._entries.popitem(last=False)
            if self.spilled is not None:
                self.spilled.save(entry)


def open_prefix_cache(
    config: EngineConfig, context: Context, target: FlashTarget, draft: Transformer | None
) -> PrefixCache:
    """Blocking: the engine's prefix cache, which holds at most the context's KV room (less
    what the requests decoding hold), with the prefixes spilled to `config.prompt_cache_dir`
    by earlier engines of the same weights on this machine (their headers read)."""
    spilled = None
    if config.prompt_cache_dir is not None:
        key = cache_key(weights_identity(config, target) | {"dtypes": _dtypes(target, draft)})
        shapes = (
            KVShape.of(target.args, target.dtype),
            KVShape.of(draft.args, draft.dtype) if draft is not None else None,
        )
        spilled = KVFiles(Path(config.prompt_cache_dir), key, SPILLED_PROMPT_CACHE, shapes)
    room_bytes = context.room_tokens * context.kv_bytes_per_token
    return PrefixCache(min(config.prompt_cache, room_bytes), context.kv_bytes_per_token, spilled)


def _dtypes(target: FlashTarget, draft: Transformer | None) -> list[str]:
    return [str(target.dtype), str(draft.dtype) if draft is not None else ""]
