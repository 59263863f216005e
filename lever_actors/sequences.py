"""A request's sequence state, apart from the engine that runs it: what it asked for, its
text so far, and its KV caches, which start from the prefix cache's longest match."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import trio

from lever_actors.channels.messages import StepStats
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.config import EngineConfig
from lever_actors.context import Context
from lever_actors.errors import ContextLengthError
from lever_actors.model.kv_cache import KVCache, position_bytes
from lever_actors.model.transformer import Transformer
from lever_actors.prefix_cache import NO_REUSE, PrefixCache, Reuse
from lever_actors.progress import Progress
from lever_actors.request import GenerationOptions
from lever_actors.target import FlashTarget


@dataclass
class Request:
    prompt: list[int]
    options: GenerationOptions
    progress: Progress | None  # of its prefill
    # called once the engine has done with it, perhaps before its consumer took the last
    # events (a stalled one): what a server counts as running can end then
    on_done: Callable[[], None] | None = None
    # cancels the wait and the prefill at the deadline (lifted at the first token)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    created: float = field(default_factory=time.perf_counter)
    error: BaseException | None = None
    steps: list[StepStats] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # emitted so far
    reuse: Reuse = NO_REUSE  # what it starts from, claimed when it starts running
    deadline: float = math.inf  # on trio's clock: after it, the step that ends is the last

    def __post_init__(self) -> None:
        if self.options.deadline_seconds is not None:
            self.deadline = trio.current_time() + self.options.deadline_seconds
            self.scope.deadline = self.deadline

    @property
    def past_deadline(self) -> bool:
        return trio.current_time() >= self.deadline

    @property
    def text_tokens(self) -> list[int]:
        """The prompt and what it has emitted: the text its KV caches hold a prefix of."""
        return [*self.prompt, *self.tokens]


def tokens_of(
    tokenizer: Tokenizer,
    prompt: str | Sequence[int] | None,
    messages: Sequence[Mapping[str, str]] | None,
    options: GenerationOptions,
    context: Context,
) -> list[int]:
    """Blocking (a worker thread): the text, or `messages` rendered, encoded; unless its
    length alone shows that it cannot fit `context` (then ContextLengthError, at once)."""
    text = tokenizer.apply_chat_template(messages) if messages is not None else prompt
    assert isinstance(text, str)  # text, or messages rendered (the engine's check)
    room = context.tokens - options.max_new_tokens
    if len(text.encode()) > room:  # only then can the bound below exceed the room
        least = tokenizer.fewest_tokens(text)
        if least > room:
            raise ContextLengthError(
                f"prompt (at least {least} tokens: {len(text):,} characters) + "
                f"max_new_tokens ({options.max_new_tokens}) exceeds the context of "
                f"{context.tokens} tokens ({context.why})",
                least,
                context.tokens,
            )
    return tokenizer.encode(text)


def new_caches(
    request: Request,
    prefixes: PrefixCache,
    target: FlashTarget,
    draft: Transformer | None,
    config: EngineConfig,
) -> tuple[KVCache, KVCache | None]:
    """Blocking: the request's KV caches, target's and draft's, sized for its prompt, new
    tokens and a tree, and started from the longest prefix `prefixes` holds."""
    request.reuse = prefixes.claim(request.prompt)
    nodes = config.tree.max_nodes
    room = len(request.prompt) + request.options.max_new_tokens + nodes + 2
    target_cache = target.new_cache(room)
    draft_cache = None
    if draft is not None:
        ahead_room = nodes if config.draft_ahead else 0
        draft_cache = draft.new_cache(room + ahead_room)
    request.reuse.restore(target_cache, draft_cache)
    return target_cache, draft_cache


def kv_bytes_per_token(target: FlashTarget, draft: Transformer | None) -> int:
    """What a token costs in a request's KV caches, target's and draft's."""
    draft_bytes = position_bytes(draft.args, draft.dtype) if draft is not None else 0
    return position_bytes(target.args, target.dtype) + draft_bytes
