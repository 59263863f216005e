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
from collections import OrderedDict

import torch

from lever_actors.model.sampling import MASK64, Sampling

NUCLEUS_HEAD = 1024  # tokens sorted for top-p when they hold its mass


class Chooser:
    """Chooses one request's tokens by its `sampling`, keeping the noise of the positions it
    used last: a tree's nodes at one depth share a position, and successive steps overlap.
    Each actor keeps its own (they run on different threads)."""

    def __init__(
        self, sampling: Sampling, kept_positions: int = 16, noise_dtype=torch.float64
    ) -> None:
        self.sampling = sampling
        self._kept = kept_positions
        self._noise_dtype = noise_dtype  # float32 for a drafter, which only ranks
        self._noise: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()

    def choose(self, logits: torch.Tensor, positions: torch.Tensor) -> list[int]:
        """logits: [n, vocab], positions: [n] absolute positions of the chosen tokens
        -> the n tokens: the argmax of the logits, or of filtered(logits / T) + noise"""
        if self.sampling.greedy:  # bf16 widened (exactly): float32's argmax is 3x as fast
            return logits.to(torch.promote_types(logits.dtype, torch.float32)).argmax(-1).tolist()
        noises = self._rows(positions, logits.shape[-1])
        temperature = self.sampling.temperature
        return [
            int((filtered(row.double() / temperature, self.sampling) + noise).argmax())
            for row, noise in zip(logits, noises, strict=True)
        ]

    def draft_scores(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """logits: [n, vocab] -> [n, vocab] scores whose order ranks a draft's candidates: the
        logits when greedy, else logits / T + the target's noise, in float32 and unfiltered
        (a proposal needs no exact rounding and no sort), so that the top candidate is the
        token the draft would draw."""
        if self.sampling.greedy:
            return logits
        widened = logits.float()
        # less the row's top first: no finite logit / T then overflows float32 (ranks as before)
        scores = (widened - widened.amax(-1, keepdim=True)) / self.sampling.temperature
        for row, noise in zip(scores, self._rows(positions, logits.shape[-1]), strict=True):
            row += noise
        return scores

    def _rows(self, positions: torch.Tensor, vocab: int) -> list[torch.Tensor]:
        rows = []
        for position in positions.tolist():
            key = (int(position), vocab)
            if key not in self._noise:
                noise = gumbel(self.sampling.seed, key[0], vocab)
                self._noise[key] = noise.to(self._noise_dtype)
                while len(self._noise) > self._kept:
                    self._noise.popitem(last=False)
            self._noise.move_to_end(key)
            rows.append(self._noise[key])
        return rows


def filtered(scaled: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """scaled: [vocab] float64 logits / T -> the same with filtered-out tokens at -inf."""
    drop = torch.zeros_like(scaled, dtype=torch.bool)
    if 0 < sampling.top_k < scaled.numel():
        drop |= scaled < torch.topk(scaled, sampling.top_k).values[-1]
    probs = torch.softmax(scaled.masked_fill(drop, -math.inf), dim=-1)
    if sampling.top_p < 1:
        drop |= ~_nucleus(probs, sampling.top_p)
    if sampling.min_p > 0:
        drop |= probs < sampling.min_p * probs.max()
    return scaled.masked_fill(drop, -math.inf)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[vocab] bool: the likeliest tokens until their mass reaches top_p. Sorting the whole
    vocabulary costs milliseconds, so only the head is sorted where it holds that mass."""
    head = min(NUCLEUS_HEAD, probs.numel())
    ordered, order = torch.topk(probs, head)
    if head < probs.numel() and float(ordered.sum()) < top_p:
        ordered, order = torch.sort(probs, descending=True, stable=True)
    before = torch.cumsum(ordered, dim=-1) - ordered  # mass of the likelier tokens
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[before < top_p]] = True
    return keep


def gumbel(seed: int, position: int, vocab: int) -> torch.Tensor:
    """[vocab] float64 standard Gumbel noise, a function of (seed, position) alone."""
    generator = torch.Generator().manual_seed(_mix(seed, position))
    uniform = torch.rand(vocab, generator=generator, dtype=torch.float64)
    return -torch.log(-torch.log(uniform))


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): neighbouring positions get unrelated generator seeds."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def top_logprobs(logits: torch.Tensor, k: int) -> list[tuple[tuple[int, float], ...]]:
    """logits: [n, vocab] -> each row's `k` most likely tokens and their log-probabilities
    (float64, before temperature and filtering), most likely first."""
    top = torch.topk(torch.log_softmax(logits.double(), dim=-1), k, dim=-1)
    return [
        tuple(zip(ids, values, strict=True))
        for ids, values in zip(top.indices.tolist(), top.values.tolist(), strict=True)
    ]


def logprobs(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    """logits: [n, vocab] -> the model's log-probability of tokens[i] under row i (float64,
    before temperature and filtering)."""
    return [
        float(torch.log_softmax(row.double(), dim=-1)[token])
        for row, token in zip(logits, tokens, strict=True)
    ]
