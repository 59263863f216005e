"""A quantized model's forward pass without torch (#63): numpy arrays for its weights and
KV cache, our plain kernels (model/plain.py) for the arithmetic, a layer in one call. It
computes what model/transformer.py computes on our torch ops, bit for bit: the same kernels,
the same roundings, the same rotary tables.

It takes what our fused layer takes (model/fused.py): plain pre-norm layers (no Gemma norms,
qk norm, sliding window or fused projections) whose matrices are all quantized; an embedding
table dense in bf16 or in int4rows; rope without llama3's scaling.
"""

from __future__ import annotations

import time
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lever_actors.errors import ConfigError
from lever_actors.model import plain
from lever_actors.model.args import ModelArgs
from lever_actors.model.drawing import drawn, gumbel
from lever_actors.model.frequencies import shared_inverse_frequencies
from lever_actors.model.sampling import GREEDY, Sampling
from lever_actors.model.shapes import rows_per_chunk

GROUP = 32  # inputs per int4rows scale and zero (model/quantized.py)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values -> their bf16 bits (uint16), rounded to nearest even as torch rounds."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


def float32_of(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> their values as float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class DenseRows:
    """An embedding table in bf16: [vocab, d] bits."""

    table: np.ndarray

    def rows(self, ids: Sequence[int]) -> np.ndarray:
        return self.table[list(ids)]


@dataclass(frozen=True)
class Int4Rows:
    """An int4rows embedding table (model/quantized.py's QuantizedRows): per row, `inputs / 2`
    bytes of nibbles (two inputs each, low first), then a bf16 (scale, zero) per 32 inputs."""

    records: np.ndarray  # [vocab, inputs / 2 + inputs / 32 * 4] uint8
    inputs: int

    def rows(self, ids: Sequence[int]) -> np.ndarray:
        """[n] -> [n, inputs] bf16"""
        return decode_int4_rows(self.records[list(ids)], self.inputs)


def decode_int4_rows(records: np.ndarray, inputs: int) -> np.ndarray:
    """int4rows records [n, inputs / 2 + inputs / 8] uint8 -> their values [n, inputs] bf16:
    (q - 8) * scale + zero in float32, each op rounded as torch's, then to bf16."""
    n, half = len(records), inputs // 2
    nibbles = records[:, :half]
    q = np.stack((nibbles & 15, nibbles >> 4), axis=-1).reshape(n, -1, GROUP)
    pairs = float32_of(np.ascontiguousarray(records[:, half:]).view(np.uint16)).reshape(n, -1, 2)
    values = (q.astype(np.float32) - np.float32(8)) * pairs[..., :1] + pairs[..., 1:]
    return bf16_bits(values.reshape(n, inputs))


class Embedding(Protocol):
    """Where a model's embedding rows come from: a table in DRAM, or flash."""

    def rows(self, ids: Sequence[int]) -> np.ndarray: ...  # [n] -> [n, d] bf16


@dataclass(frozen=True)
class Weights:
    embed: Embedding
    layers: list[plain.Layer]
    final_norm: np.ndarray  # [d] bf16
    lm_head: plain.Matrix


class KVCache:
    """Keys and values [L, KV, capacity, hd] bf16 and each slot's position [capacity] int64; a
    pass writes its pending block after the committed `length`, then the caller commits it,
    keeps some of it (a tree's accepted path) or drops it (model/kv_cache.py's, in numpy)."""

    def __init__(self, args: ModelArgs, capacity: int) -> None:
        shape = (args.n_layers, args.n_kv_heads, capacity, args.head_dim)
        self.keys = np.zeros(shape, np.uint16)
        self.values = np.zeros(shape, np.uint16)
        self.positions = np.zeros(capacity, np.int64)
        self.capacity = capacity
        self.length = 0

    def room_for(self, span: int) -> None:
        if self.length + span > self.capacity:
            end = self.length + span
            raise ConfigError(f"KV cache full: {end} positions needed, capacity {self.capacity}")

    def commit(self, n: int) -> None:
        self.length += n

    def keep(self, offsets: Sequence[int]) -> None:
        """Keep the pending slots at these offsets (ascending), packed after the prefix."""
        source = np.asarray(offsets, np.int64) + self.length
        kept = slice(self.length, self.length + len(offsets))
        self.keys[:, :, kept] = self.keys[:, :, source]  # fancy indexing copies first
        self.values[:, :, kept] = self.values[:, :, source]
        self.positions[kept] = self.positions[source]
        self.length += len(offsets)


class Model:
    """A quantized model held in numpy arrays, run on the plain kernels."""

    def __init__(self, args: ModelArgs, weights: Weights) -> None:
        why = unsupported(args)
        if why:
            raise ConfigError(f"the plain path cannot run this model: {why}")
        self.args = args
        self.weights = weights
        self.inv_freq = shared_inverse_frequencies(args)
        scale = (args.query_scale or args.head_dim) ** -0.5
        self.shape = plain.Shape(
            args.n_heads, args.head_dim, args.norm_eps, scale, args.attn_softcap or 0.0
        )

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.args, capacity)

    def chain(self, context: int, n: int) -> plain.Rows:
        """n tokens continuing `context` committed ones, each seeing those before it."""
        positions = np.arange(context, context + n, dtype=np.int64)
        mask = None
        if n > 1:  # one token sees everything
            block = np.tril(np.ones((n, n), np.bool_))
            mask = np.concatenate((np.ones((n, context), np.bool_), block), axis=1)
        return self.rows(positions, mask)

    def rows(
        self, positions: np.ndarray, mask: np.ndarray | None, offsets: np.ndarray | None = None
    ) -> plain.Rows:
        """Rows at these positions [n], under `mask` [n, context + n] (None: all), in the
        pending slots `offsets` (None: 0..n-1)."""
        assert self.inv_freq is not None  # _unsupported refused llama3's scaling
        cos, sin = plain.rope_tables(positions, self.inv_freq)
        return plain.Rows(positions, cos, sin, offsets, mask, len(positions))

    def forward(
        self, tokens: Sequence[int], cache: KVCache, rows: plain.Rows | None = None
    ) -> np.ndarray:
        """tokens [n] -> final hidden states [n, d] bf16, leaving n pending slots in `cache`.
        Without `rows`, a chain after the committed length, `rows_per_chunk` rows at a time
        through every layer (a long prompt's temporaries stay within CHUNK_BYTES a layer):
        each row's bits are the same, the kernels computing each row on its own."""
        cache.room_for(rows.span if rows is not None else len(tokens))
        if rows is not None:
            return self._layers(tokens, cache, cache.length, rows)
        step = rows_per_chunk(self.args, cache.length + len(tokens))
        chunks = []
        for lo in range(0, len(tokens), step):
            part = tokens[lo : lo + step]
            at = cache.length + lo  # the chunks before it are pending: this one sees them
            chunks.append(self._layers(part, cache, at, self.chain(at, len(part))))
        return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)

    def _layers(
        self, tokens: Sequence[int], cache: KVCache, length: int, rows: plain.Rows
    ) -> np.ndarray:
        x = self.weights.embed.rows(tokens)
        for i, layer in enumerate(self.weights.layers):
            x = plain.decoder_layer(x, layer, cache, i, length, rows, self.shape)
        return x

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [n, d] -> [n, vocab] bf16: the final norm, then the LM head."""
        normed = plain.rms_norm(hidden, self.weights.final_norm, self.args.norm_eps)
        return plain.linear(normed, self.weights.lm_head)


def greedy(logits: np.ndarray) -> list[int]:
    """Each row's argmax over bf16 logits [n, vocab] (the first of equals, as torch's)."""
    return float32_of(logits).argmax(-1).tolist()


def chosen(logits: np.ndarray, sampling: Sampling, position: int) -> int:
    """logits: [1, vocab] bf16 -> the token at absolute `position`, chosen as the engine's
    model/choosing.py chooses it: the argmax, or drawn with the noise of (seed, position)."""
    if sampling.greedy:
        return greedy(logits)[0]
    scaled = float32_of(logits[0]).astype(np.float64) / sampling.temperature
    return drawn(scaled, sampling, gumbel(sampling.seed, position, scaled.size))


class Proposer(Protocol):
    """Tokens a pass verifies beyond the one it computes: what may follow the text
    (policy/plain_copies.py's copies)."""

    cap: int  # most tokens proposed at once

    def proposed(self, committed: Sequence[int]) -> list[int]:
        """The tokens to verify after the text, extended first by those `committed` since
        the last call."""
        ...

    def verified(self, rows: int, proposed: int, taken: int, seconds: float) -> None:
        """A pass of `rows` rows verified `proposed` tokens in `seconds`; the first `taken`
        held."""
        ...


def token_stream(
    model: Model,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_ids: Container[int] = frozenset(),
    sampling: Sampling = GREEDY,
    proposer: Proposer | None = None,
) -> Iterator[int]:
    """Decoding after `prompt`, yielding each token as it comes, up to `max_new_tokens` or a
    token of `stop_ids` (yielded too): model/sequential.py's `sequential_stream` on the plain
    path, greedy or seeded. With a `proposer`, a pass also verifies its tokens after the
    one it computes, each row giving the bits it gives alone: a proposed token is taken
    while it is the token chosen at its place, so the tokens are those of one a pass."""
    cache = model.new_cache(len(prompt) + max_new_tokens + (proposer.cap if proposer else 0))
    pending, committed = list(prompt), list(prompt)
    made = 0
    while True:
        proposed = proposer.proposed(committed) if proposer else []
        started = time.perf_counter()
        hidden = model.forward([*pending, *proposed], cache)
        cache.commit(len(pending))  # the proposed tokens' slots stay pending
        logits = model.logits(hidden[len(pending) - 1 :])  # [1 + proposed, vocab]
        committed = []
        for row, guess in enumerate([*proposed, None]):
            committed.append(chosen(logits[row : row + 1], sampling, cache.length + row))
            if committed[-1] != guess:
                break
        taken = len(committed) - 1
        if proposer:
            rows = len(pending) + len(proposed)
            proposer.verified(rows, len(proposed), taken, time.perf_counter() - started)
        cache.keep(range(taken))
        for token in committed:
            yield token
            made += 1
            if token in stop_ids or made == max_new_tokens:
                return
        pending = committed[-1:]


def unsupported(args: ModelArgs) -> str:
    """Why the plain path cannot run a model of these args, or ''."""
    if args.gemma or args.qk_norm or args.fused_projections or args.final_softcap:
        return "Gemma's norms and caps, qk norms and fused projections run on torch"
    if any(args.window(layer) is not None for layer in range(args.n_layers)):
        return "sliding windows run on torch"
    if args.head_dim % 8 or args.n_heads // args.n_kv_heads > 8:
        return f"{args.n_heads} heads of {args.head_dim} over {args.n_kv_heads}"
    if shared_inverse_frequencies(args) is None:
        return "llama3's rope scaling runs on torch"
    return ""
