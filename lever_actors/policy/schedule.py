"""What runs when, decided apart from what runs it. Pure and trio-free: the engine's batch
and the verifier tell these what arrived and do what they answer.

- `Places`: which requests in line take places in the batch. In arrival order, the
  head of the line takes a place when fewer than `parallel` are placed and the KV it may
  fill fits beside the placed ones' in the room (a request alone always fits: its size
  was checked against the context).
- `Passes`: when the verifier's arrivals make a job of draft rounds (every seat still
  drafting has sent its round) and when they make a pass (every seat has sent its tree)."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Seated = TypeVar("Seated")
Tree = TypeVar("Tree")
Round = TypeVar("Round")


@dataclass
class Places:
    """The places of the requests decoding at once (by seat, in arrival order) and the
    line of those waiting (by ticket). Each call answers the (ticket, seat) pairs that
    took places because of it, in order."""

    parallel: int
    room_tokens: int
    placed: dict[int, int] = field(default_factory=dict)  # seat -> the KV it may fill
    line: deque[tuple[int, int]] = field(default_factory=deque)  # (ticket, KV it may fill)
    _seats: itertools.count = field(default_factory=itertools.count)

    def join(self, ticket: int, kv_tokens: int) -> list[tuple[int, int]]:
        """A request enters the line."""
        self.line.append((ticket, kv_tokens))
        return self._admit()

    def withdraw(self, ticket: int) -> list[tuple[int, int]]:
        """A request leaves the line before it took a place: those behind it may fit now."""
        self.line = deque(waiting for waiting in self.line if waiting[0] != ticket)
        return self._admit()

    def leave(self, seat: int) -> list[tuple[int, int]]:
        """A placed request leaves its place."""
        del self.placed[seat]
        return self._admit()

    def _admit(self) -> list[tuple[int, int]]:
        admitted = []
        while self.line:
            ticket, kv_tokens = self.line[0]
            full = len(self.placed) >= self.parallel
            if self.placed and (full or sum(self.placed.values()) + kv_tokens > self.room_tokens):
                break
            self.line.popleft()
            seat = next(self._seats)
            self.placed[seat] = kv_tokens
            admitted.append((ticket, seat))
        return admitted


@dataclass
class Passes(Generic[Seated, Tree, Round]):
    """Who sits in each seat of the verifier's batch, and what each has sent for the next
    pass: its tree, or a round of draft forwards while it still drafts one."""

    seated: dict[int, Seated] = field(default_factory=dict)  # by seat
    trees: dict[int, Tree] = field(default_factory=dict)  # the next pass's, by seat
    rounds: dict[int, Round] = field(default_factory=dict)  # waiting for the others', by seat
    # seats whose requests wait for their consumers: no pass waits for them until their
    # next tree
    aside: set[int] = field(default_factory=set)

    def seat(self, seat: int, seated: Seated) -> None:
        self.seated[seat] = seated

    def unseat(self, seat: int) -> Seated | None:
        """Its request left: what it sent goes with it. Who sat there, if anyone still did."""
        self.trees.pop(seat, None)
        self.rounds.pop(seat, None)
        self.aside.discard(seat)
        return self.seated.pop(seat, None)

    def step_aside(self, seat: int) -> None:
        """Its request waits for its consumer: the passes and rounds go on without it."""
        if seat in self.seated and seat not in self.trees:
            self.aside.add(seat)

    def add_round(self, seat: int, round_: Round) -> bool:
        """False where its request has gone (nothing waits for the round)."""
        if seat not in self.seated:
            return False
        self.rounds[seat] = round_
        return True

    def add_tree(self, seat: int, tree: Tree) -> None:
        assert seat in self.seated  # the caller took its commit from who sits there
        self.aside.discard(seat)
        self.trees[seat] = tree

    def rounds_ready(self) -> list[Round]:
        """The rounds to run as one job, once no other is coming: every seat without a
        tree has sent its round. Empty until then; taken when answered."""
        drafting = self.seated.keys() - self.trees.keys() - self.aside
        if not self.rounds or not drafting <= self.rounds.keys():
            return []
        ready, self.rounds = list(self.rounds.values()), {}
        return ready

    def pass_ready(self) -> list[tuple[int, Seated, Tree]]:
        """The next pass's trees, with who sent them, in seat order, once every seat not
        aside has sent one. Empty until then; taken when answered."""
        if not self.trees or self.trees.keys() != self.seated.keys() - self.aside:
            return []
        ready = [(seat, self.seated[seat], self.trees[seat]) for seat in sorted(self.trees)]
        self.trees = {}
        return ready
