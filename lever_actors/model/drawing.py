"""Seeded sampling's arithmetic in numpy: the noise of a position and the filtered scores it
is added to. The engine (model/choosing.py) and the plain path (model/plain_model.py) both
draw through it, so a seed draws the same tokens on either; no torch here.

Sampling is Gumbel-max with noise keyed by (seed, absolute position): the token at position
t is argmax(filtered(logits / T) + g(seed, t)), whose distribution is the filtered softmax
at temperature T. Every row is filtered and perturbed on its own in float64.
"""

from __future__ import annotations

import numpy as np

from lever_actors.model.sampling import MASK64, Sampling

NUCLEUS_HEAD = 1024  # tokens sorted for top-p when they hold its mass


def drawn(scaled: np.ndarray, sampling: Sampling, noise: np.ndarray) -> int:
    """scaled: [vocab] float64 logits / T, noise: [vocab] `gumbel` -> the token drawn."""
    return int(np.argmax(filtered(scaled, sampling) + noise))


def filtered(scaled: np.ndarray, sampling: Sampling) -> np.ndarray:
    """scaled: [vocab] float64 logits / T -> the same with filtered-out tokens at -inf."""
    drop = np.zeros(scaled.shape, dtype=bool)
    if 0 < sampling.top_k < scaled.size:
        cut = scaled.size - sampling.top_k
        drop |= scaled < np.partition(scaled, cut)[cut]  # ties with the k-th are kept
    probs = _softmax(np.where(drop, -np.inf, scaled))
    if sampling.top_p < 1:
        drop |= ~_nucleus(probs, sampling.top_p)
    if sampling.min_p > 0:
        drop |= probs < sampling.min_p * probs.max()
    return np.where(drop, -np.inf, scaled)


def _softmax(scaled: np.ndarray) -> np.ndarray:
    exps = np.exp(scaled - scaled.max())
    return exps / exps.sum()


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """[vocab] bool: the likeliest tokens until their mass reaches top_p. Sorting the whole
    vocabulary costs milliseconds, so only the head is sorted where it holds that mass."""
    order = _likeliest(probs, NUCLEUS_HEAD)
    if order.size < probs.size and float(probs[order].sum()) < top_p:
        order = _likeliest(probs, probs.size)
    ordered = probs[order]
    before = np.cumsum(ordered) - ordered  # mass of the likelier tokens
    keep = np.zeros(probs.shape, dtype=bool)
    keep[order[before < top_p]] = True
    return keep


def _likeliest(probs: np.ndarray, count: int) -> np.ndarray:
    """The ids of at least the `count` likeliest tokens (all those as likely as the count-th),
    likeliest first and equals by id: which of equals reaches top_p is then defined."""
    if count < probs.size:
        cut = probs.size - count
        ids = np.flatnonzero(probs >= np.partition(probs, cut)[cut])
    else:
        ids = np.arange(probs.size)
    return ids[np.lexsort((ids, -probs[ids]))]


def gumbel(seed: int, position: int, vocab: int) -> np.ndarray:
    """[vocab] float64 standard Gumbel noise, a function of (seed, position) alone."""
    uniform = np.random.Generator(np.random.PCG64(_mix(seed, position))).random(vocab)
    with np.errstate(divide="ignore"):  # a uniform of exactly 0 is noise -inf: never drawn
        return -np.log(-np.log(uniform))


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): neighbouring positions get unrelated generator seeds."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)
