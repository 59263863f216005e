"""The prefix cache: the target's and the draft's KV of finished requests, kept in an LRU so
that a request that starts with the same tokens (a conversation's next turn, a shared
system prompt) prefills only the rest.

Reuse is exact: a position's keys and values are a function of the tokens up to it alone,
whichever pass computed them (the kernels are row-invariant: tests/test_prefix_cache.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from lever_actors.model.kv_cache import KVCache, KVPrefix


@dataclass(frozen=True)
class CachedPrefix:
    """A finished request's text and the KV both models hold of it: the target's of all of
    it, the draft's of its tokens from `draft_start` on (the draft's view, sequences.py)."""

    tokens: tuple[int, ...]
    target: KVPrefix
    draft: KVPrefix | None  # None without a draft model
    draft_start: int = 0

    @property
    def nbytes(self) -> int:
        return self.target.nbytes + (self.draft.nbytes if self.draft else 0)


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
    """Prefixes of at most `capacity_bytes` in all; the least recently used go first."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def claim(self, prompt: Sequence[int]) -> Reuse:
        """The entry that shares the longest prefix with `prompt`, up to its last token (whose
        pass gives the first new token). An entry the prompt extends whole leaves the cache:
        the request will store its longer text in its place."""
        best, shared = None, 0
        for entry in self._entries.values():
            n = _common_length(entry.tokens, prompt[:-1])
            if n > shared:
                best, shared = entry, n
        if best is None:
            return NO_REUSE
        if shared == len(best.tokens):
            del self._entries[best.tokens]
        else:
            self._entries.move_to_end(best.tokens)
        return Reuse(shared, best)

    def store(
        self,
        tokens: Sequence[int],
        target: KVCache,
        draft: KVCache | None,
        draft_start: int = 0,
    ) -> None:
        """Keep the KV both caches hold of `tokens`' first positions (as many as both hold;
        the draft's cache holds them from `draft_start` on), dropping entries it extends
        and then the least recently used until all fit; a prefix larger than the whole cache
        is not kept."""
        draft_end = draft_start + draft.length if draft else target.length
        length = min(target.length, draft_end, len(tokens))
        if length == 0 or self.capacity_bytes == 0:
            return
        kept = tuple(tokens[:length])
        for old in [t for t in self._entries if kept[: len(t)] == t]:
            del self._entries[old]
        drafted = draft.prefix(max(0, length - draft_start)) if draft else None
        entry = CachedPrefix(kept, target.prefix(length), drafted, draft_start)
        if entry.nbytes > self.capacity_bytes:
            return
        self._entries[kept] = entry
        while self.nbytes > self.capacity_bytes:
            self._entries.popitem(last=False)


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
