"""The engine: loads the models once (loading.py), then serves requests, several at once
(batch.py), wiring the actors (wiring.py).

The prefetcher, the verifier and the pruner serve the requests in the batch while it has
any (crew.py). Each request runs its drafter, projector and step loop in a nursery of
its own, inside the engine's nursery, so that a request that ends early (break,
cancellation, an error) takes them and its channels with it. What a finished one leaves is
its text's KV, in the prefix cache (prefix_cache.py).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Unpack

import msgspec
import trio

from lever_actors.channels.bounded import ChannelSet
from lever_actors.channels.messages import TokenEvent
from lever_actors.channels.trace import Tracer
from lever_actors.checkpoints.gguf_layout import gguf_layout
from lever_actors.checkpoints.layout_cache import is_gguf
from lever_actors.checkpoints.tokenizer import Message, Tokenizer, layout_tokenizer
from lever_actors.config import EngineConfig
from lever_actors.device.manifest import Manifest, read_manifest
from lever_actors.device.memory import return_freed_heap
from lever_actors.device.units import ComputeUnit
from lever_actors.draft import DraftModel
from lever_actors.engine.batch import Batch
from lever_actors.engine.crew import Crew, original
from lever_actors.engine.intake import Asked, take_in
from lever_actors.engine.loading import LoadTimes, load
from lever_actors.engine.prefix_cache import PrefixCache
from lever_actors.engine.results import GenerationResult, result_of
from lever_actors.engine.state import LEAST_TREE_NODES, RequestState, kv_tokens
from lever_actors.engine.switching import PlanSwitch
from lever_actors.engine.wiring import run_request
from lever_actors.errors import ConfigError, DeadlineError, EngineClosedError
from lever_actors.model.transformer import Transformer
from lever_actors.options import GenerationKeywords, GenerationOptions, options_of
from lever_actors.paths import default_cache_dir
from lever_actors.plan.context import Context
from lever_actors.plan.start import Proposal, StartPlan, propose, refuse_early
from lever_actors.policy.pruning import keep_everything
from lever_actors.policy.setup import Policies
from lever_actors.progress import Progress
from lever_actors.target import FlashTarget

__all__ = ["Engine", "GenerationResult", "LoadTimes"]


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        target: FlashTarget,
        draft: Transformer | None,
        policies: Policies,
        units: tuple[ComputeUnit, ComputeUnit],
        nursery: trio.Nursery,
        plan: StartPlan,
        prefixes: PrefixCache,
        load_times: LoadTimes,
    ) -> None:
        self.config = config
        self.plan = plan  # what was decided at start from the machine and the limit
        self.load_times = load_times
        self.target = target
        self.tokenizer: Tokenizer | None = target.tokenizer
        self.policies = policies
        # the draft, until the plan gives way to copies of the text (engine/switching.py)
        self.switch = PlanSwitch(config, plan, target, policies, draft, nursery)
        self.spec = policies.spec
        self.npu, self.cpu = units
        self._nursery = nursery
        # the requests decoding at once, and those waiting for a place
        self.batch = Batch(plan.parallel, plan.context.room_tokens)
        self.tracer = Tracer(config.trace) if config.trace else None
        # the actors every request shares (their channels: crew.channels)
        self.crew = Crew(self.batch, config, target, policies, self.switch, self.npu, self.tracer)
        self.prefixes = prefixes  # finished requests' KV, for those that start the same
        self._closed = False
        # the channels of the request placed last (with several at once, any of them)
        self.channels: ChannelSet | None = None

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        config: EngineConfig,
        *,
        draft: DraftModel | None = None,
        progress: Progress | None = None,
    ) -> AsyncIterator[Engine]:
        """Make the start-up plan (plan/start.py), load what it needs (the config was
        checked when it was built) and serve requests until the block ends.

        `draft` may pass an already loaded draft model (engines can share one); otherwise
        it is loaded from `config.draft` where the plan drafts. `progress(done, total,
        label)` hears about the start-up profiling of a cost-sized tree.
        """
        drafts = draft is not None or config.draft is not None
        if config.plan is None and config.tree.needs_draft and not drafts:
            raise ConfigError(f"tree {str(config.tree)!r} needs a draft model; set draft")
        # planning, loading and profiling on the "npu" unit's thread too: no other thread of
        # ours starts an OpenMP team (units.py)
        npu = ComputeUnit("npu")
        units = (npu, ComputeUnit("cpu") if config.units == "split" else npu)
        try:
            if is_gguf(Path(config.target)):  # as it is: its layout in the cache, made once
                layout = await npu.run(gguf_layout, Path(config.target), default_cache_dir())
                config = msgspec.structs.replace(config, target=str(layout))
            manifest = read_manifest(Path(config.target))
            # a limit that cannot hold the process beside the target's least budget is
            # refused before anything is parsed; then the tokenizer: its parse peaks about
            # 130 MB above the 46 MiB it keeps (the real pair's), which then comes before
            # any weights, and the plans count what it keeps (the target's, and a draft's
            # of the same bytes, reuse it)
            refuse_early(config, manifest)
            await npu.run(layout_tokenizer, Path(config.target), manifest)
            return_freed_heap()
            proposal = await npu.run(propose, config, manifest, draft is not None)
            async with cls._serving(manifest, proposal, draft, units, progress) as engine:
                yield engine
        finally:
            for unit in set(units):
                unit.close()

    @classmethod
    @asynccontextmanager
    async def _serving(
        cls,
        manifest: Manifest,
        proposal: Proposal,
        draft: DraftModel | None,
        units: tuple[ComputeUnit, ComputeUnit],
        progress: Progress | None,
    ) -> AsyncIterator[Engine]:
        npu = units[0]
        async with load(manifest, proposal, draft, npu, progress) as loaded:
            engine: Engine | None = None
            draft_model, loaded.draft = loaded.draft, None  # the engine's alone: it may let go
            try:
                async with trio.open_nursery() as nursery:
                    engine = cls(
                        proposal.config,
                        loaded.target,
                        draft_model,
                        loaded.policies,
                        units,
                        nursery,
                        loaded.plan,
                        loaded.prefixes,
                        loaded.times,
                    )
                    draft_model = None
                    nursery.start_soon(engine.crew.run)
                    try:
                        yield engine
                    finally:
                        engine._closed = True
                    nursery.cancel_scope.cancel()  # requests still running end with the block
            except BaseExceptionGroup as group:
                raise original(group) from None
            finally:
                if engine is not None:  # its requests have ended with the nursery
                    with trio.CancelScope(shield=True):  # what it holds goes to its directory
                        await npu.run(engine.prefixes.close)
                    engine._let_go_of_weights()
                    if engine.tracer is not None:
                        engine.tracer.close()

    @property
    def draft(self) -> Transformer | None:
        """The draft model new requests propose from; None without one, or once let go."""
        return self.switch.draft

    @property
    def context(self) -> Context:
        """How many tokens a request may fill, and why (the start-up plan's)."""
        return self.plan.context

    def _let_go_of_weights(self) -> None:
        """A closed engine may live on in a caller's variable, say while the next one opens:
        it then holds none of its weights (an engine of the real pair at 1 GiB kept 420 MB)."""
        self.switch.draft = None
        self.policies.prune = keep_everything  # the lens shares the target's LM head
        self.prefixes = PrefixCache(0, 0)
        self.target.close()

    async def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Message] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: GenerationOptions | None = None,
        progress: Progress | None = None,
        **keywords: Unpack[GenerationKeywords],
    ) -> GenerationResult:
        """Run one request to the end (see `stream` for the arguments); the result carries
        the text, per-token log-probabilities and per-step statistics."""
        events: list[TokenEvent] = []
        options = options_of(options, keywords)
        request = await self._request(prompt, messages, tools, options, progress)
        async for event in self._events(request):
            events.append(event)
        return result_of(request, events)

    async def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Message] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: GenerationOptions | None = None,
        progress: Progress | None = None,
        on_done: Callable[[], None] | None = None,
        **keywords: Unpack[GenerationKeywords],
    ) -> AsyncGenerator[TokenEvent, None]:
        """Yield each token as it is accepted. Leaving the loop early cancels the request.

        Give either `prompt`, raw text (no chat template) or token ids, or `messages`, a
        conversation of {"role": "system" | "user" | "assistant" | "tool", "content": str}
        (an assistant's with its `tool_calls`, a tool's with its `tool_call_id`) that the
        model's chat template renders, ending with the assistant's prompt; `tools`, function
        definitions (name, description, parameters), go to the template too.

        `options` says how many tokens, where to stop, how to choose them and by when: see
        `GenerationOptions` (options.py) for its fields and rules. Or give those fields flat
        as keywords (`GenerationKeywords`: `max_new_tokens`, `temperature`, `seed`, ...).

        `progress(done, total, "prefill")` hears how many of a long prompt's tokens (256 or
        more, not cached) the prefill's pass has taken through the target's layers.
        `on_done()` is called once the engine has done with the request (it ended, failed,
        was cancelled or its consumer stalled), which may be before the loop has taken the
        last events.

        The text is rendered and tokenized on a worker thread, so that a long one holds up
        no other task of the event loop; one that cannot fit the context is refused from its
        length alone."""
        options = options_of(options, keywords)
        request = await self._request(prompt, messages, tools, options, progress)
        request.on_done = on_done
        async for event in self._events(request):
            yield event

    async def stream_choices(
        self,
        n: int,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Message] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: GenerationOptions | None = None,
        on_done: Callable[[], None] | None = None,
        **keywords: Unpack[GenerationKeywords],
    ) -> AsyncGenerator[tuple[int, TokenEvent], None]:
        """`n` choices of one request (OpenAI's `n`), each a request of the batch with the
        options of its index (`GenerationOptions.choice`), decoded together: yield
        (index, event) as each comes. Leaving the loop early cancels them all; the first
        error of one is raised once all have ended. `on_done()` once the engine has done
        with every choice. The arguments are `stream`'s."""
        options = options_of(options, keywords)
        choices = [
            await self._request(prompt, messages, tools, options.choice(index))
            for index in range(n)
        ]
        left = [n]

        def one_done() -> None:
            left[0] -= 1
            if left[0] == 0 and on_done is not None:
                on_done()

        size = self.config.channels.events
        merged, taken = trio.open_memory_channel[tuple[int, TokenEvent]](n * size)
        with merged:
            for index, request in enumerate(choices):
                request.on_done = one_done
                send, receive = trio.open_memory_channel[TokenEvent](size)
                self._nursery.start_soon(self._serve, request, send)
                self._nursery.start_soon(_tagged, index, receive, merged.clone())
        try:
            with taken:
                async for pair in taken:
                    yield pair
        finally:
            for request in choices:  # a consumer that stopped early ends them all
                request.scope.cancel()
        if errors := [request.error for request in choices if request.error is not None]:
            raise errors[0]

    async def _request(
        self,
        prompt: str | Sequence[int] | None,
        messages: Sequence[Message] | None,
        tools: Sequence[Mapping[str, Any]] | None,
        options: GenerationOptions,
        progress: Progress | None = None,
    ) -> RequestState:
        if self._closed:
            raise EngineClosedError("this engine was closed; open another")
        asked = Asked(prompt, messages, tools, options, progress)
        return await take_in(asked, self.tokenizer, self.target.args.vocab_size, self.context)

    async def _events(self, request: RequestState) -> AsyncIterator[TokenEvent]:
        send, receive = trio.open_memory_channel[TokenEvent](self.config.channels.events)
        self._nursery.start_soon(self._serve, request, send)
        try:
            with receive:
                async for event in receive:
                    yield event
        finally:
            request.scope.cancel()  # a consumer that stopped early ends the request
        if request.error is not None:
            raise request.error

    async def _serve(
        self, request: RequestState, events: trio.MemorySendChannel[TokenEvent]
    ) -> None:
        try:
            with events, request.scope:
                try:
                    await self._run_placed(request, events)
                except Exception as error:  # handed to the consumer, who raises it
                    request.error = original(error)
            if request.scope.cancelled_caught and request.past_deadline:
                request.error = DeadlineError(
                    f"no token within the deadline of {request.options.deadline_seconds:g} s: "
                    "the request was cancelled"
                )
        finally:
            if request.on_done is not None:
                request.on_done()

    async def _run_placed(
        self, request: RequestState, events: trio.MemorySendChannel[TokenEvent]
    ) -> None:
        """Wait in line for a place in the batch, then run the request in it: with a whole
        tree's KV, or a smaller tree's where the room beside the others has no more."""
        nodes = self.config.tree.max_nodes
        least = kv_tokens(request, min(nodes, LEAST_TREE_NODES))
        async with self.batch.place(kv_tokens(request, nodes), least) as place:
            request.tree_nodes = place.kv_tokens - kv_tokens(request, 0)
            self.channels = ChannelSet(self.tracer)
            try:
                with place.scope:  # cancelled where an actor the batch shares fails
                    await run_request(
                        request,
                        place,
                        self.crew,
                        events,
                        self.channels,
                        self.draft,
                        (self.npu, self.cpu),
                        self.prefixes,
                    )
            except Exception:
                if place.failure is None:  # else the channels it saw close were the crew's
                    raise
        if place.failure is not None:
            assert place.crew is not None  # the crew it joined failed
            await place.crew.wait()  # nothing of that crew still runs once the request raises
            raise place.failure


async def _tagged(
    index: int,
    events: trio.MemoryReceiveChannel[TokenEvent],
    merged: trio.MemorySendChannel[tuple[int, TokenEvent]],
) -> None:
    """A choice's events onto the channel of all, with its index, until either end closes."""
    with events, merged:
        async for event in events:
            try:
                await merged.send((index, event))
            except trio.BrokenResourceError:  # the consumer left: its choices end
                return
