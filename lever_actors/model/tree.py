"""A token tree: nodes in topological order, each with its parent (-1 for the first node)."""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field

import torch

from lever_actors.model.masks import with_context


@dataclass(frozen=True)
class TokenTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        depths: list[int] = []
        for i, parent in enumerate(self.parents):
            if (parent == -1) != (i == 0) or not -1 <= parent < i:
                raise ValueError(
                    f"node {i} has parent {parent}: only node 0 is a root, "
                    "and parents come before their children"
                )
            depths.append(0 if parent == -1 else depths[parent] + 1)
        object.__setattr__(self, "depths", tuple(depths))

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> TokenTree:
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestry(self) -> torch.Tensor:
        """[n, n] bool: row i marks node i and every ancestor of i."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i] = mask[parent]
            mask[i, i] = True
        return mask

    def attention_mask(self, context: int) -> torch.Tensor:
        """[n, context+n] bool: each node sees the committed context and its own ancestors."""
        return with_context(context, self.ancestry())

    def positions(self, context: int) -> torch.Tensor:
        """[n] int64: a node's position is its depth after the context."""
        return torch.tensor(self.depths, dtype=torch.int64) + context

    def children(self, node: int) -> list[int]:
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the first node down to `node`, inclusive."""
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def predicted_chain(self, node: int, ranks: Sequence[int], live: Container[int]) -> list[int]:
        """`node` and, below it, each time the `live` child the drafter ranked best."""
        chain = [node]
        while True:
            below = [c for c in self.children(chain[-1]) if c in live]
            if not below:
                return chain
            chain.append(min(below, key=lambda c: ranks[c]))

    def without(self, dropped: Sequence[int]) -> list[bool]:
        """alive[i]: False for dropped nodes and all their descendants."""
        alive = [True] * len(self)
        gone = set(dropped)
        for i, parent in enumerate(self.parents):
            alive[i] = i not in gone and (parent == -1 or alive[parent])
        return alive
