"""The context a request may fill: the model's own, or less where the memory left after
loading holds less KV. The KV of target and draft per token is known (KVCache), and so is
what the process may hold (its cgroup's limit, else the machine's free memory)."""

from __future__ import annotations

import math

import msgspec

from lever_actors.errors import ConfigError
from lever_actors.model.shapes import CHUNK_BYTES
from lever_actors.sizes import format_bytes

# Of the memory left after loading, less a step's temporaries (a layer's are bounded by
# model/shapes.py's CHUNK_BYTES; a 318-token prompt's pass took 48 MiB, trimmed after): the
# share one request's KV may fill (its context), and the share the KV of the requests
# decoding at once and the prefix cache's entries fill together, the cache giving way
TEMPORARY_BYTES = CHUNK_BYTES
KV_SHARE = 0.5
POOL_SHARE = 0.75


def room_bytes(kv_bytes_per_token: int, tokens: int) -> int:
    """The memory to keep after loading for a context of `tokens`: a step's temporaries, and
    the context's KV as KV_SHARE of the rest."""
    return TEMPORARY_BYTES + math.ceil(kv_bytes_per_token * tokens / KV_SHARE)


def tokens_in(free: int, kv_bytes_per_token: int, share: float = KV_SHARE) -> int:
    """The tokens of KV `share` of `free` bytes after loading holds, less a step's
    temporaries: at KV_SHARE, one context (room_bytes' inverse)."""
    return int(max(free - TEMPORARY_BYTES, 0) * share) // max(kv_bytes_per_token, 1)


class Context(msgspec.Struct, frozen=True):
    """The context an engine serves, and where its size came from."""

    tokens: int  # n_ctx: a request's prompt and new tokens together, at most
    model_tokens: int  # the model's own context
    kv_bytes_per_token: int  # target's and draft's
    limit_bytes: int  # what the process may hold
    free_bytes: int  # of which not yet held after loading
    asked: bool  # set by ctx_size, not derived from memory

    @property
    def room_tokens(self) -> int:
        """The KV the requests decoding at once and the prefix cache may hold together, in
        tokens: POOL_SHARE of the memory left after loading, or one whole context where that
        was asked for. The cache holds what the requests' reservations leave."""
        pool = tokens_in(self.free_bytes, self.kv_bytes_per_token, POOL_SHARE)
        return max(self.tokens, pool)

    @property
    def why(self) -> str:
        """Where its size comes from, for an error message."""
        if self.asked:
            return "ctx_size"
        if self.tokens < self.model_tokens:
            return (
                f"what the {format_bytes(self.free_bytes)} left of a "
                f"{format_bytes(self.limit_bytes)} memory limit holds; set ctx_size for more"
            )
        return "the model's"

    def __str__(self) -> str:
        kv = f"{format_bytes(self.kv_bytes_per_token)} of KV a token"
        free = f"{format_bytes(self.free_bytes)} free of {format_bytes(self.limit_bytes)}"
        if self.asked:
            source = f"ctx_size; the model's {self.model_tokens:,}, {kv}, {free}"
        elif self.tokens == self.model_tokens:
            source = f"the model's; {kv}, {free}"
        else:
            source = f"what {free} holds at {kv}; the model's {self.model_tokens:,}"
        return f"context {self.tokens:,} tokens ({source})"


def plan_context(
    asked: int | None, model_tokens: int, kv_bytes_per_token: int, limit: int, held: int
) -> Context:
    """`asked` tokens (ctx_size), at most the model's; else the model's, or as many as the
    memory left after loading (`limit` less `held`) holds."""
    free = max(limit - held, 0)
    check_ctx_size(asked, model_tokens)
    fits = tokens_in(free, kv_bytes_per_token)
    tokens = asked if asked is not None else min(model_tokens, fits)
    return Context(tokens, model_tokens, kv_bytes_per_token, limit, free, asked is not None)


def check_ctx_size(asked: int | None, model_tokens: int) -> None:
    """A ctx_size beyond the model's context is refused, naming it."""
    if asked is not None and asked > model_tokens:
        raise ConfigError(
            f"ctx_size {asked:,} exceeds the model's context of {model_tokens:,} tokens"
        )
