"""What runs when, decided apart from what runs it. Pure and trio-free: the engine's batch
and the verifier tell these what arrived and do what they answer.

- `Places`: which requests in line take places in the batch. In arrival order, the
  head of the line takes a place when fewer than `parallel` are placed and the KV it may
  fill fits beside the placed ones' in the room, whole or down to the least it may start
  with (a smaller tree): as much as is free (a request alone always fits: its size was
  checked against the context).
- `Passes`: when the verifier's arrivals make a job of draft rounds (every seat still
  drafting has sent its round) and when they make a pass (every seat has sent its tree).
- `PrefillChunks`, `chunk_end`: how much of a joining request's prompt a pass takes beside
  the requests already decoding (a newcomer's prompt comes in a chunk a pass, so that their
  next tokens keep coming)."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
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
    # (ticket, the KV it may fill, the least it may start with)
    line: deque[tuple[int, int, int]] = field(default_factory=deque)
    _seats: itertools.count = field(default_factory=itertools.count)

    @property
    def free_tokens(self) -> int:
        """The KV room the placed requests leave (the prefix cache's, engine/prefix_cache.py)."""
        return max(0, self.room_tokens - sum(self.placed.values()))

    def join(
        self, ticket: int, kv_tokens: int, least_tokens: int | None = None
    ) -> list[tuple[int, int]]:
        """A request enters the line: it may fill `kv_tokens`, and where they do not fit
        beside the placed requests it takes what is free, `least_tokens` at least."""
        least = kv_tokens if least_tokens is None else min(least_tokens, kv_tokens)
        self.line.append((ticket, kv_tokens, least))
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
            ticket, kv_tokens, least = self.line[0]
            full = len(self.placed) >= self.parallel
            if self.placed and (full or least > self.free_tokens):
                break
            self.line.popleft()
            seat = next(self._seats)
            self.placed[seat] = min(kv_tokens, self.free_tokens) if self.placed else kv_tokens
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


# a joining prompt takes at least this many rows a pass, so that it gets on even beside
# requests whose steps are short; where no cost model prices the rows (one token a pass, a
# static tree) its first chunk takes this many, and later ones what the rows added taught
LEAST_CHUNK_ROWS = 16
# a draft catching up beside other requests takes this many rows a round where no cost
# model prices them (actors/drafter.py)
UNPRICED_CHUNK_ROWS = 64
# the step's time and the chunks' pace move this share toward each pass: recent ones count
STEP_WEIGHT = 0.3


@dataclass
class PrefillChunks:
    """How much of joining requests' prompts rides along each pass of the requests already
    decoding: rows whose compute costs about one of their steps, so that none of them waits
    more than twice its step for its next token while a long prompt comes in. Prompts go
    whole, in one pass, where nobody decodes beside them, and where those decoding have
    not yet made a step with no prompt beside them (requests that came at once: the
    first to start would only slow the others' start)."""

    # seconds of a pass's compute, by its rows (None: unpriced, a row's cost learned instead)
    verify: Callable[[int], float] | None
    # the decoding requests' step: seconds from the start of one of their passes to the
    # next, learned from passes with no prompt in them (0: none yet)
    step_seconds: float = 0.0
    # what a prompt's rows added to the step, against what `verify` prices them at: their
    # draft's catching up and a pass's narrow products cost more than a pass's share
    pace: float = 1.0
    # without `verify`: seconds a prompt's row added to the step, as seen (None: none yet;
    # 64 rows a pass, unpriced, held 3 requests' next tokens 1.2-1.7 s against a 0.27 s step)
    row_seconds: float | None = None
    # seconds of a whole pass by its rows (reads, compute, head): which of the prompts that
    # came together share a pass (None: all of them, in one)
    pass_seconds: Callable[[int], float] | None = None

    def rows(self, decoding_rows: int, wanted: int) -> int | None:
        """The prompts' rows this pass may take beside `decoding_rows` of decoding
        requests, of `wanted`; None: no bound."""
        if decoding_rows == 0 or self.step_seconds == 0:
            return None
        if self.verify is None:
            if self.row_seconds is None:
                return LEAST_CHUNK_ROWS
            row = self.row_seconds

            def added(rows: int) -> float:  # what the prompt's rows add to the step
                return row * rows

        else:
            verify, base = self.verify, self.verify(decoding_rows)

            def added(rows: int) -> float:
                return self.pace * (verify(decoding_rows + rows) - base)

        return rows_within(self.step_seconds, added, wanted)

    def together(self, decoding: int, decoding_rows: int, prompts: list[int]) -> list[bool]:
        """Which of `prompts` (the rows each has left) a pass takes whole beside `decoding`
        requests of `decoding_rows` whose step is not known yet (requests that came at once):
        the shortest, then each next shortest while what its rows add to the pass, paid by
        every request already in it, costs less than a pass of its own, paid by it and by
        each prompt after it. Resident, so a short prompt's first token does not wait for
        the long ones' rows (8 at once: seven first tokens came together after 10.6 s); where
        a pass waits on its reads, prompts ride along under them."""
        if self.pass_seconds is None or len(prompts) < 2:
            return [True] * len(prompts)
        price = self.pass_seconds
        order = sorted(range(len(prompts)), key=lambda i: prompts[i])
        own_pass = price(1)
        rows, held = decoding_rows + prompts[order[0]], decoding + 1
        taken = {order[0]}
        for after, i in enumerate(order[1:], start=1):
            added = price(rows + prompts[i]) - price(rows)
            if held * added >= (len(order) - after) * own_pass:
                break  # the longer ones after it would add more, for fewer
            taken.add(i)
            rows, held = rows + prompts[i], held + 1
        return [i in taken for i in range(len(prompts))]

    def observe(self, seconds: float) -> None:
        """A step of the decoding requests with no prompt beside them took `seconds`."""
        if self.step_seconds == 0:
            self.step_seconds = seconds
        else:
            self.step_seconds += STEP_WEIGHT * (seconds - self.step_seconds)

    def observe_chunk(self, seconds: float, decoding_rows: int, rows: int) -> None:
        """A step of the decoding requests with `rows` of a prompt beside their
        `decoding_rows` took `seconds`: what the rows added teaches `pace` (without
        `verify`, a row's own seconds)."""
        if self.step_seconds == 0 or rows == 0:
            return
        added = max(seconds - self.step_seconds, 0.0)
        if self.verify is None:
            seen = added / rows
            known = self.row_seconds
            self.row_seconds = seen if known is None else known + STEP_WEIGHT * (seen - known)
            return
        priced = self.verify(decoding_rows + rows) - self.verify(decoding_rows)
        if priced > 0:
            seen = added / priced
            self.pace += STEP_WEIGHT * (seen - self.pace)

    def forget(self) -> None:
        """Nobody decodes: the next requests' step is their own."""
        self.step_seconds = 0.0


def rows_within(seconds: float, cost: Callable[[int], float], wanted: int) -> int:
    """The most rows, up to `wanted` but at least LEAST_CHUNK_ROWS, whose `cost` (rising
    with the rows) stays within `seconds`."""
    lo, hi = LEAST_CHUNK_ROWS, max(LEAST_CHUNK_ROWS, wanted)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= seconds:
            lo = mid
        else:
            hi = mid - 1
    return lo


def chunk_end(start: int, size: int, committed: int, rows: int | None) -> int:
    """Where a pass's share of a tree of `size` nodes, `committed` of them its prompt's
    (or the last step's) tokens, ends when it starts at `start` and may take `rows`: the
    tree's end once the rows reach its last committed node, since that node and the drafts
    below it are what its verdict is made of; else `rows` further (None: no bound)."""
    if rows is None or start + rows >= committed - 1:
        return size
    return start + rows
