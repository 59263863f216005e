"""How many requests decode at once, where `parallel` was not given: as many chat turns as
the KV room left after loading holds."""

from __future__ import annotations

from lever_actors.config import EngineConfig
from lever_actors.plan.context import Context

# a request's tokens the automatic `parallel` plans for: a chat turn with its history
AUTO_REQUEST_TOKENS = 1024
MAX_AUTO_PARALLEL = 8


def parallel_of(config: EngineConfig, context: Context) -> int:
    """Requests that may decode at once: config.parallel, else as many requests of
    AUTO_REQUEST_TOKENS as the KV room holds (at least one, at most MAX_AUTO_PARALLEL)."""
    if config.parallel is not None:
        return config.parallel
    return max(1, min(MAX_AUTO_PARALLEL, context.room_tokens // AUTO_REQUEST_TOKENS))
