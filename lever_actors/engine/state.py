"""A request's state while the engine runs it: what it asked for, its text so far, and its
KV caches, which start from the prefix cache's longest match.

The draft's view of the text may begin later than the text does (`draft_start`): it
proposes from recent tokens, and prefilling a long prompt's whole length in the draft
cost a quarter of the wait for its first token. The target always sees all of it, so the
output is the same whatever the draft sees."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from lever_actors.channels.messages import StepStats
from lever_actors.config import EngineConfig
from lever_actors.engine.prefix_cache import NO_REUSE, PrefixCache, Reuse
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.matcher import Matcher
from lever_actors.model.transformer import Transformer
from lever_actors.options import GenerationOptions
from lever_actors.progress import Progress
from lever_actors.target import FlashTarget

# a request beside others starts with trees this small, where the room has no more, rather
# than wait for a whole tree's: four at once under 1 GiB held 5-10 nodes a tree, and the
# fourth, 38 tokens short of a 64-node tree's room, waited 29 s
LEAST_TREE_NODES = 16


@dataclass
class RequestState:
    prompt: list[int]
    options: GenerationOptions
    progress: Progress | None  # of its prefill
    matcher: Matcher | None = None  # its grammar's, which the projector advances
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
    draft_start: int = 0  # the text's first token in the draft's view (its KV's first)
    tree_nodes: int = 0  # the most draft nodes its trees hold: what its place's KV has room for
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


def new_caches(
    request: RequestState,
    prefixes: PrefixCache,
    target: FlashTarget,
    draft: Transformer | None,
    config: EngineConfig,
    free_tokens: int,
) -> tuple[KVCache, KVCache | None]:
    """Blocking: the request's KV caches, target's and draft's, sized for its prompt, new
    tokens and a tree, and started from the longest prefix `prefixes` holds (the draft's
    from where its view begins, `request.draft_start`); the prefix cache first gives way to
    them (`free_tokens`: the KV room the placed requests leave, this one's counted)."""
    request.reuse = reuse = prefixes.claim(request.prompt, free_tokens)
    nodes = request.tree_nodes
    room = kv_tokens(request, nodes)
    target_cache = target.new_cache(room)
    reuse.restore(target_cache)
    draft_cache = None
    if draft is not None:
        request.draft_start = draft_view(reuse, len(request.prompt), config.draft_window)
        ahead_room = nodes if config.draft_ahead else 0
        draft_cache = draft.new_cache(room - request.draft_start + ahead_room)
        if request.draft_start == reuse.draft_start:
            reuse.restore_draft(draft_cache)
    return target_cache, draft_cache


def kv_tokens(request: RequestState, tree_nodes: int) -> int:
    """The positions a request's KV caches hold at most: its prompt, its new tokens and a
    tree of `tree_nodes` (and the bonus token and the chain's last, beyond the tree)."""
    return len(request.prompt) + request.options.max_new_tokens + tree_nodes + 2


def draft_view(reuse: Reuse, prompt_tokens: int, window: int | None) -> int:
    """Where the draft's view of a request's text begins: where the reused KV's does, when
    the draft holds some of it and the prompt's new tokens fit the window; else at the
    window's start, the last `window` prompt tokens (None: the text's start)."""
    fresh = 0 if window is None else max(0, prompt_tokens - window)
    new_tokens = prompt_tokens - reuse.tokens
    if reuse.draft_tokens and (window is None or new_tokens <= window):
        return reuse.draft_start
    return fresh
