"""Proposals copied from the committed text: where a path's last tokens occurred before, the
tokens that followed them there (prompt lookup). They cost no draft forward, so a gain-cost
tree can go deeper where the text repeats itself (a list, code quoted back) than its draft
rounds pay for; the target verifies them like any node, so the output is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

MATCH = 3  # tokens a path's end must share with an earlier place in the text
LOOKUP_RANK = -1  # a tree node's draft rank when it was copied, not drafted
LOOKUP_PRIOR = 0.5  # a copied token's acceptance before any was verified


class ContextIndex:
    """The committed tokens, with where each run of MATCH tokens last occurred with at least
    one token after it."""

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # MATCH tokens -> where the next one is
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            at = len(self.tokens)
            if at >= MATCH:  # the run before `token` now has a token after it
                self._after[tuple(self.tokens[at - MATCH : at])] = at
            self.tokens.append(token)

    def follower(self, path: Sequence[int]) -> int | None:
        """The token that followed the last earlier occurrence of the text's end extended by
        `path` (its last MATCH tokens); None where those never occurred."""
        end = [*self.tokens[-MATCH:], *path][-MATCH:]
        at = self._after.get(tuple(end)) if len(end) == MATCH else None
        return None if at is None else self.tokens[at]


def copies_that_pay(
    context: ContextIndex, rate: float, cap: int, pass_rate: Callable[[int, float], float]
) -> list[int]:
    """The copies after the text's end worth verifying in one pass: each taken while the
    pass's expected tokens per unit of its time improve. Each copy is accepted with `rate`
    given its parent was; `pass_rate(n, tokens)` prices a pass verifying n copies that is
    expected to commit `tokens` (its own token among them)."""
    copies: list[int] = []
    reach, expected = 1.0, 0.0  # the chance every copy so far is accepted; their sum
    best = pass_rate(0, 1.0)
    while len(copies) < cap:
        token = context.follower(copies)
        if token is None:
            break
        gain = reach * rate
        score = pass_rate(len(copies) + 1, 1 + expected + gain)
        if score <= best:
            break
        copies.append(token)
        reach, expected, best = gain, expected + gain, score
    return copies


class CopySteps(NamedTuple):
    """What steps of copies alone would have done on a text: per step, on average."""

    tokens: float  # committed: the run of copies the text matched, then the target's own
    nodes: float  # verified: the last committed token's row, and every copy proposed


def copy_steps(text: Sequence[int], start: int, cap: int) -> CopySteps:
    """Steps of copies alone (plan lookup) on `text` from `start` on, had every copy found
    been verified: each step commits the run of copies that matches the text, then one
    token of the target's own; a copy that did not match was verified too. Teacher-forced,
    so it is read off a prompt before any step runs; one token and one node a step where
    the text never repeats itself."""
    index = ContextIndex(text[:start])
    steps, nodes, at = 0, 0, start
    while at < len(text):
        copies: list[int] = []
        missed = 0
        while len(copies) < cap and at + len(copies) < len(text):
            token = index.follower(copies)
            if token != text[at + len(copies)]:
                missed = int(token is not None)
                break
            copies.append(token)
        taken = min(len(copies) + 1, len(text) - at)
        index.extend(text[at : at + taken])
        at += taken
        steps += 1
        nodes += 1 + len(copies) + missed
    if not steps:
        return CopySteps(1.0, 1.0)
    return CopySteps((len(text) - start) / steps, nodes / steps)
