"""Choosing the next token: greedy, or seeded sampling that speculation cannot change.

Sampling is Gumbel-max with noise keyed by (seed, absolute position): the token at position
t is argmax(filtered(logits / T) + g(seed, t)), whose distribution is the filtered softmax at
temperature T. Because the noise depends only on the seed and the position, a tree node's
token is a deterministic function of its context, exactly as under greedy decoding, so
verification stays a comparison and the output equals sequential sampling with the same
seed, whatever the draft, the tree or the timing. The drafter adds the same noise to its
own logits, so it proposes the token the target is likely to draw.

Every row is filtered and perturbed on its own in float64: a row's token never depends on
the other rows in its batch.
"""

from __future__ import annotations

import math
import secrets

import msgspec
import torch

from lever_actors.errors import ConfigError

_MASK64 = (1 << 64) - 1


class Sampling(msgspec.Struct, frozen=True):
    """How the next token is chosen. temperature 0 is greedy (the other fields are unused)."""

    temperature: float = 0.0
    top_k: int = 0  # keep the k likeliest tokens (ties at the k-th kept too); 0: no limit
    top_p: float = 1.0  # keep the likeliest tokens whose probabilities reach p (nucleus)
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest one
    seed: int = 0  # the noise's key; `Sampling.drawn` draws one when the user gave none

    def __post_init__(self) -> None:
        checks = (
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, ">= 0"),
            ("top_k", self.top_k >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p < 1, "in [0, 1)"),
            ("seed", 0 <= self.seed <= _MASK64, f"in [0, {_MASK64}]"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"{name} = {getattr(self, name)!r}: expected {expected}")

    @classmethod
    def drawn(cls, seed: int | None = None, **fields) -> Sampling:
        """`Sampling(**fields)` with `seed`, or with a freshly drawn one when it is None."""
        return cls(seed=secrets.randbits(63) if seed is None else seed, **fields)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


def choose(logits: torch.Tensor, positions: torch.Tensor, sampling: Sampling) -> list[int]:
    """logits: [n, vocab], positions: [n] absolute positions of the tokens chosen -> n tokens"""
    return scores(logits, positions, sampling).argmax(-1).tolist()


def scores(logits: torch.Tensor, positions: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """logits: [n, vocab] -> [n, vocab] whose argmax per row is the chosen token: the logits
    themselves when greedy, else filtered(logits / T) + noise in float64 (-inf: filtered)."""
    if sampling.greedy:
        return logits
    rows = [
        filtered(row.double() / sampling.temperature, sampling)
        + gumbel(sampling.seed, int(p), row.numel())
        for row, p in zip(logits, positions.tolist(), strict=True)
    ]
    return torch.stack(rows)


def filtered(scaled: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """scaled: [vocab] float64 logits / T -> the same with filtered-out tokens at -inf."""
    drop = torch.zeros_like(scaled, dtype=torch.bool)
    if 0 < sampling.top_k < scaled.numel():
        drop |= scaled < torch.topk(scaled, sampling.top_k).values[-1]
    probs = torch.softmax(scaled.masked_fill(drop, -math.inf), dim=-1)
    if sampling.top_p < 1:
        ordered, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(ordered, dim=-1) - ordered  # mass of the likelier tokens
        drop[order[before >= sampling.top_p]] = True
    if sampling.min_p > 0:
        drop |= probs < sampling.min_p * probs.max()
    return scaled.masked_fill(drop, -math.inf)


def gumbel(seed: int, position: int, vocab: int) -> torch.Tensor:
    """[vocab] float64 standard Gumbel noise, a function of (seed, position) alone."""
    generator = torch.Generator().manual_seed(_mix(seed, position))
    uniform = torch.rand(vocab, generator=generator, dtype=torch.float64)
    return -torch.log(-torch.log(uniform))


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): neighbouring positions get unrelated generator seeds."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def logprobs(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    """logits: [n, vocab] -> the model's log-probability of tokens[i] under row i (float64,
    before temperature and filtering)."""
    return [
        float(torch.log_softmax(row.double(), dim=-1)[token])
        for row, token in zip(logits, tokens, strict=True)
    ]
