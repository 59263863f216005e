"""A preallocated per-model KV cache: committed prefix plus a pending block being verified."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lever_actors.errors import ConfigError
from lever_actors.model.args import ModelArgs


class KVCache:
    """Keys/values for every layer: [n_layers, n_kv_heads, capacity, head_dim], and the
    sequence position of each slot's token: [capacity] (sliding windows are judged on it).

    A forward pass writes its n new tokens into the pending block [length, length+n) at
    each layer; afterwards the caller commits all of them, keeps a subset (the accepted
    path of a token tree) or drops them. Positions before `length` are never touched.
    """

    def __init__(self, args: ModelArgs, capacity: int, dtype: torch.dtype) -> None:
        shape = (args.n_layers, args.n_kv_heads, capacity, args.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)
        self.values = torch.zeros(shape, dtype=dtype)
        self.positions = torch.zeros(capacity, dtype=torch.int64)
        self.capacity = capacity
        self.length = 0

    def write(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        offsets: torch.Tensor | None = None,
        span: int | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [n_kv_heads, n, hd] of tokens at `positions` [n] (default: their slots, as
        for a chain), stored at pending `offsets` (default 0..n-1).
        -> the context plus `span` pending slots (default n): [n_kv_heads, length+span, hd]"""
        n = k.shape[1]
        end = self.room_for(span if span is not None else n)
        slots = slice(self.length, self.length + n) if offsets is None else self.length + offsets
        self.keys[layer, :, slots] = k
        self.values[layer, :, slots] = v
        if positions is None:  # a chain: each token's position is its slot
            positions = (
                torch.arange(self.length, self.length + n) if isinstance(slots, slice) else slots
            )
        self.positions[slots] = positions
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def room_for(self, span: int) -> int:
        """The end of a pending block of `span` slots; ConfigError where the cache is full."""
        end = self.length + span
        if end > self.capacity:
            raise ConfigError(f"KV cache full: {end} positions needed, capacity {self.capacity}")
        return end

    def commit(self, n: int) -> None:
        """Keep all n pending positions, in order."""
        self.length += n

    def keep(self, offsets: Sequence[int], pending: Sequence[int] = ()) -> None:
        """Keep the pending positions at these offsets (ascending), packed after the prefix;
        then move those at `pending`, still uncommitted, right behind them in that order."""
        moved = [*offsets, *pending]
        if moved != list(range(len(moved))):
            src = torch.tensor(moved, dtype=torch.int64) + self.length
            dst = slice(self.length, self.length + len(moved))
            # index_select copies first, so overlapping source and destination are safe
            self.keys[:, :, dst] = self.keys.index_select(2, src)
            self.values[:, :, dst] = self.values.index_select(2, src)
            self.positions[dst] = self.positions[src]
        self.length += len(offsets)

    def prefix_bytes(self, length: int) -> int:
        """What `prefix(length)` will hold."""
        slots = (t.nbytes // self.capacity for t in (self.keys, self.values, self.positions))
        return length * sum(slots) if self.capacity else 0

    def prefix(self, length: int) -> KVPrefix:
        """A compact copy of the first `length` committed positions."""
        if not 0 <= length <= self.length:
            raise ValueError(f"a cache of length {self.length} has no prefix of {length}")
        return KVPrefix(
            self.keys[:, :, :length].clone(),
            self.values[:, :, :length].clone(),
            self.positions[:length].clone(),
        )

    def restore(self, prefix: KVPrefix, length: int) -> None:
        """Start this empty cache from the first `length` positions of `prefix`."""
        if self.length:
            raise ValueError("only an empty cache starts from a prefix")
        if not 0 <= length <= prefix.length:
            raise ValueError(f"a prefix of length {prefix.length} has no first {length}")
        self.room_for(length)
        self.keys[:, :, :length] = prefix.keys[:, :, :length]
        self.values[:, :, :length] = prefix.values[:, :, :length]
        self.positions[:length] = prefix.positions[:length]
        self.length = length

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` committed positions."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length


@dataclass(frozen=True)
class KVPrefix:
    """The committed positions of a KVCache, copied out of it (`KVCache.prefix`): keys and
    values [n_layers, n_kv_heads, length, head_dim], positions [length]."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor

    @property
    def length(self) -> int:
        return self.positions.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.keys, self.values, self.positions))
