"""The engine: loads the models once, then serves requests by wiring the five actors.

Each request runs its actors in a nursery of its own, inside the engine's nursery, so that
a request that ends early (break, cancellation, an error) takes all its actors and
channels with it and the next request starts clean. Requests are served one at a time;
what a finished one leaves is its text's KV, in the prefix cache (prefix_cache.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, Unpack

import msgspec
import trio

from lever_actors.actors.drafter import Drafter, DrafterInbox, DraftPolicy
from lever_actors.actors.jitter import Jitter
from lever_actors.actors.prefetcher import Prefetcher
from lever_actors.actors.projector import Projector
from lever_actors.actors.pruner import Pruner
from lever_actors.actors.verifier import Verifier, VerifierInbox, VerifierOutbox
from lever_actors.channels.bounded import ChannelSet
from lever_actors.channels.messages import (
    Commit,
    DraftRequest,
    DraftTree,
    ExitProbe,
    FinalHidden,
    FinishReason,
    LayerWeights,
    PruneVerdict,
    SlotRelease,
    StepStats,
    TokenEvent,
    TopLogprob,
    Verdict,
)
from lever_actors.channels.stats import (
    DecodePhase,
    decode_phase,
    decode_rate,
    per_step,
    prefill_rate,
)
from lever_actors.checkpoints.tokenizer import Message, Tokenizer
from lever_actors.config import DramBudget, EngineConfig, check_request_size
from lever_actors.context import Context, plan_context
from lever_actors.device.budget import ResidencyPlan, minimum_budget, plan_residency
from lever_actors.device.layout import Manifest, read_manifest
from lever_actors.device.memory import (
    anonymous_rss_bytes,
    file_rss_bytes,
    map_large_blocks,
    memory_limit_bytes,
    peak_rss_bytes,
    return_freed_heap,
)
from lever_actors.device.units import ComputeUnit
from lever_actors.draft import DraftModel, load_draft
from lever_actors.errors import (
    ConfigError,
    ConsumerStalledError,
    DeadlineError,
    EngineClosedError,
)
from lever_actors.memory_plan import AUTO_CONTEXT, MemoryPlan, plan_memory
from lever_actors.model.kv_cache import position_bytes
from lever_actors.model.transformer import Transformer
from lever_actors.paths import path_bytes
from lever_actors.policy.pruning import keep_everything
from lever_actors.policy.setup import Policies, build_policies
from lever_actors.prefix_cache import PrefixCache
from lever_actors.progress import Progress
from lever_actors.request import GenerationKeywords, GenerationOptions, options_of
from lever_actors.sequences import (
    Request,
    grammar_matcher,
    kv_bytes_per_token,
    new_caches,
    prefix_cache,
    tokens_of,
)
from lever_actors.stop_text import StopText
from lever_actors.target import FlashTarget


class GenerationResult(msgspec.Struct, frozen=True):
    tokens: list[int]  # the end token that stopped generation included
    text: str  # special tokens never appear in it, nor a stop string that ended it (keep_stop)
    logprobs: list[float]  # per token: the target's log-probability of it
    pieces: list[str]  # per token: its own text in context (stop strings aside)
    # per token, where the request asked (top_logprobs): its position's likeliest tokens
    top_logprobs: list[tuple[TopLogprob, ...]]
    steps: list[StepStats]
    finish_reason: FinishReason | None  # None only when no token was generated
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV an earlier request left (prefix cache)
    seed: int | None  # the sampling seed, given or drawn; None when greedy
    prefill_seconds: float  # request start to the first token
    prefill_tokens_per_second: float | None  # prompt tokens not cached, over prefill_seconds
    decode_tokens: int  # tokens after the first step, which comes with the prefill
    decode_seconds: float  # the end of the first step to the last token
    peak_rss_bytes: int  # this process's high-water mark of resident memory so far

    @property
    def generated_tokens(self) -> int:
        return len(self.tokens)

    @property
    def decode_tokens_per_second(self) -> float | None:
        return decode_rate(self.decode_tokens, self.decode_seconds)

    @property
    def mean_accepted(self) -> float | None:
        """New tokens per step (accepted draft tokens + the bonus token)."""
        return per_step(len(self.tokens), len(self.steps))


class LoadTimes(msgspec.Struct, frozen=True):
    """Where an engine's start went, in seconds (`Engine.load_times`)."""

    draft: float  # loading the draft (a snapshot's read, or a GGUF's conversion)
    target: float  # opening the layout and reading its resident weights
    policies: float  # the cost model's start (measured once per machine), the predictor

    def __str__(self) -> str:
        return (
            f"draft {self.draft:.1f} s, target {self.target:.1f} s, policies {self.policies:.1f} s"
        )


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        target: FlashTarget,
        draft: Transformer | None,
        policies: Policies,
        units: tuple[ComputeUnit, ComputeUnit],
        nursery: trio.Nursery,
        context: Context,
        prefixes: PrefixCache,
        load_times: LoadTimes | None = None,
        memory: MemoryPlan | None = None,
    ) -> None:
        self.config = config
        self.context = context  # how many tokens a request may fill, and why
        self.memory = memory  # how the memory the process may use was shared out at start
        self.load_times = load_times
        self.target = target
        self.tokenizer: Tokenizer | None = target.tokenizer
        self.draft = draft
        self.policies = policies
        self.spec = policies.spec
        self.npu, self.cpu = units
        self._nursery = nursery
        self._one_at_a_time = trio.Lock()
        self.prefixes = prefixes  # finished requests' KV, for those that start the same
        self._closed = False
        self.channels: ChannelSet | None = None  # those of the latest request, for statistics

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        config: EngineConfig,
        *,
        draft: DraftModel | None = None,
        progress: Progress | None = None,
    ) -> AsyncIterator[Engine]:
        """Load both models (the config was checked when it was built) and serve requests
        until the block ends.

        `draft` may pass an already loaded draft model (engines can share one); otherwise
        it is loaded from `config.draft`. `progress(done, total, label)` hears about the
        start-up profiling of the gain-cost tree.
        """
        drafting = config.tree.kind != "none"
        if drafting and draft is None and config.draft is None:
            raise ConfigError(f"tree {str(config.tree)!r} needs a draft model; set draft")
        manifest = read_manifest(Path(config.target))
        # before anything loads: a limit that cannot hold the draft's file (its weights take
        # no more) beside the process and the target's least budget is refused now, not
        # killed in the load; the budget itself is planned once the draft is in
        loading = drafting and draft is None
        draft_file = path_bytes(Path(config.draft)) if loading and config.draft else 0
        process = anonymous_rss_bytes()
        memory_plan(
            config, manifest, process=process, draft=draft_file, context_tokens=0, budget=AUTO
        )
        # loading and profiling on the "npu" unit's thread too: no other thread of ours
        # starts an OpenMP team (units.py)
        npu = ComputeUnit("npu")
        units = (npu, ComputeUnit("cpu") if config.units == "split" else npu)
        try:
            async with cls._serving(config, manifest, draft, drafting, units, progress) as engine:
                yield engine
        finally:
            for unit in set(units):
                unit.close()

    @classmethod
    @asynccontextmanager
    async def _serving(
        cls,
        config: EngineConfig,
        manifest: Manifest,
        draft: DraftModel | None,
        drafting: bool,
        units: tuple[ComputeUnit, ComputeUnit],
        progress: Progress | None,
    ) -> AsyncIterator[Engine]:
        npu = units[0]
        started = time.perf_counter()
        before_draft = anonymous_rss_bytes()
        # the draft first: its loading peak (several hundred MB of temporaries) then comes
        # before the target's resident weights, not on top of them
        if draft is None and drafting:
            draft = await npu.run(
                load_draft,
                config.draft,
                config.draft_dtype,
                config.draft_weights,
                config.draft_vocabulary,
            )
            return_freed_heap()  # the load's temporaries, before the plan counts what it holds
        draft_loaded = time.perf_counter()
        drafted = draft.model if draft is not None and drafting else None
        memory = memory_plan(
            config,
            manifest,
            process=before_draft,
            draft=anonymous_rss_bytes() - before_draft,
            draft_kv_bytes_per_token=position_bytes(drafted.args, drafted.dtype) if drafted else 0,
        )
        plan = plan_residency(manifest, memory.budget, config.ring_slots)
        if plan.streams:
            map_large_blocks()  # short of memory: a step's temporaries go back as they are freed
        target = await npu.run(_open_target, config, plan)
        target_opened = time.perf_counter()
        try:
            model = None
            if draft is not None and drafting:
                _check_same_vocabulary(target, draft)
                model = draft.model.proposing(config.draft_vocabulary)
            policies = await npu.run(build_policies, config, target, model, progress)
            return_freed_heap()  # the start-up profiling's temporaries
            context = plan_context(
                config.ctx_size,
                target.args.max_seq_len,
                kv_bytes_per_token(target, model),
                memory_limit_bytes(),
                anonymous_rss_bytes(),
            )
            prefixes = await npu.run(prefix_cache, config, context, target, model)
            times = LoadTimes(
                draft=draft_loaded - started,
                target=target_opened - draft_loaded,
                policies=time.perf_counter() - target_opened,
            )
            engine: Engine | None = None
            try:
                async with trio.open_nursery() as nursery:
                    engine = cls(
                        config,
                        target,
                        model,
                        policies,
                        units,
                        nursery,
                        context,
                        prefixes,
                        times,
                        memory,
                    )
                    try:
                        yield engine
                    finally:
                        engine._closed = True
                    nursery.cancel_scope.cancel()  # requests still running end with the block
            except BaseExceptionGroup as group:
                raise _original(group) from None
            finally:
                if engine is not None:  # its requests have ended with the nursery
                    with trio.CancelScope(shield=True):  # what it holds goes to its directory
                        await npu.run(engine.prefixes.close)
                    engine._let_go_of_weights()
        finally:
            target.close()

    def _let_go_of_weights(self) -> None:
        """A closed engine may live on in a caller's variable, say while the next one opens:
        it then holds none of its weights (an engine of the real pair at 1 GiB kept 420 MB)."""
        self.draft = None
        self.policies.prune = keep_everything  # the lens shares the target's LM head
        self.prefixes = PrefixCache(0)
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
        decode_tokens, decode_seconds = decode_phase(events)
        return GenerationResult(
            tokens=[e.token for e in events],
            text="".join(e.text for e in events),
            logprobs=[e.logprob for e in events],
            pieces=[e.piece for e in events],
            top_logprobs=[e.top_logprobs for e in events],
            steps=request.steps,
            finish_reason=events[-1].finish_reason if events else None,
            prompt_tokens=len(request.prompt),
            cached_tokens=request.reuse.tokens,
            seed=request.options.sampling.reported_seed,
            prefill_seconds=events[0].elapsed_seconds if events else 0.0,
            prefill_tokens_per_second=prefill_rate(events[0]) if events else None,
            decode_tokens=decode_tokens,
            decode_seconds=decode_seconds,
            peak_rss_bytes=peak_rss_bytes(),
        )

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

        `options` (request.py) says how many tokens, where to stop and how to choose them;
        or give its fields as keywords: `max_new_tokens`, `stop`, `keep_stop`,
        `temperature`, `top_k`, `top_p`, `min_p`, `seed`, `deadline_seconds`,
        `top_logprobs`, `grammar` (model/grammar.py: a JSON schema, any JSON, a regex or a
        Lark grammar, which every token then follows, exactly as sequential decoding
        under it would). Generation ends after `max_new_tokens` ("length"), or ("stop")
        after one of the tokenizer's end tokens (`tokenizer.eos_ids`: end of text and end
        of turn), whose text is not emitted, or after the token that completes one of the
        `stop` strings: the text ends where it begins (text that may begin one is held back
        until it cannot), unless `keep_stop`.

        temperature 0 is greedy decoding. Above 0 tokens are sampled from the target's
        softmax at that temperature, after top-k, top-p (nucleus) and min-p filtering; the
        output equals sequential sampling with the same `seed`, whatever the tree. Without
        a seed one is drawn: `GenerationResult.seed` and the log report it.

        `progress(done, total, "prefill")` hears how many of a long prompt's tokens (256 or
        more, not cached) the prefill's pass has taken through the target's layers.
        `on_done()` is called once the engine has done with the request (it ended, failed,
        was cancelled or its consumer stalled), which may be before the loop has taken the
        last events.

        `deadline_seconds` ends a request in time: the step that ends after it is the last
        ("length"); a request still waiting for the engine or in its prefill then raises
        DeadlineError.

        The text is rendered and tokenized on a worker thread, so that a long one holds up
        no other task of the event loop; one that cannot fit the context is refused from its
        length alone."""
        options = options_of(options, keywords)
        request = await self._request(prompt, messages, tools, options, progress)
        request.on_done = on_done
        async for event in self._events(request):
            yield event

    async def _request(
        self,
        prompt: str | Sequence[int] | None,
        messages: Sequence[Message] | None,
        tools: Sequence[Mapping[str, Any]] | None,
        options: GenerationOptions,
        progress: Progress | None = None,
    ) -> Request:
        """Check everything about a request before any work starts."""
        if self._closed:
            raise EngineClosedError("this engine was closed; open another")
        if (prompt is None) == (messages is None):
            raise ConfigError("give either prompt or messages")
        if tools and messages is None:
            raise ConfigError("tools go with messages, which the chat template renders")
        if messages is not None or isinstance(prompt, str):
            tokenizer = self._need_tokenizer()  # text: not a torch op, so a worker thread
            encode = partial(tokens_of, tokenizer, prompt, messages, tools, options, self.context)
            ids = await trio.to_thread.run_sync(encode)
        else:
            assert prompt is not None  # one of the two, checked above
            ids = [int(t) for t in prompt]
        check_request_size(len(ids), options.max_new_tokens, self.context.tokens, self.context.why)
        vocab = self.target.args.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ConfigError(f"prompt token ids must be in [0, {vocab})")
        matcher = None
        if options.grammar is not None:  # compiled on a worker thread, as text is encoded
            start = partial(grammar_matcher, options.grammar, self._need_tokenizer(), vocab)
            matcher = await trio.to_thread.run_sync(start)
        return Request(ids, options, progress, matcher)

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ConfigError("this target has no tokenizer: pass the prompt as token ids")
        return self.tokenizer

    async def _events(self, request: Request) -> AsyncIterator[TokenEvent]:
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

    async def _serve(self, request: Request, events: trio.MemorySendChannel[TokenEvent]) -> None:
        try:
            with events, request.scope:
                try:
                    async with self._one_at_a_time:
                        await self._run_actors(request, events)
                except Exception as error:  # handed to the consumer, who raises it
                    request.error = _original(error)
            if request.scope.cancelled_caught and request.past_deadline:
                request.error = DeadlineError(
                    f"no token within the deadline of {request.options.deadline_seconds:g} s: "
                    "the request was cancelled"
                )
        finally:
            if request.on_done is not None:
                request.on_done()

    async def _run_actors(
        self, request: Request, events: trio.MemorySendChannel[TokenEvent]
    ) -> None:
        config, target = self.config, self.target
        sizes = config.channels
        ch = self.channels = ChannelSet(config.trace)
        requests = ch.open("requests", DraftRequest, sizes.requests)
        trees = ch.open("trees", DraftTree, sizes.trees)
        # room for the resident layers too: queued, they cost no memory, and the verifier
        # applies the layers that have arrived in one job
        room = max(target.plan.ring_slots, 1) + len(target.resident_layers)
        layers = ch.open("layers", LayerWeights, room)
        releases = ch.open("releases", SlotRelease, max(target.plan.ring_slots, 1))
        probes = ch.open("probes", ExitProbe, sizes.probes)
        prune_verdicts = ch.open("prune_verdicts", PruneVerdict, sizes.prune_verdicts)
        finals = ch.open("finals", FinalHidden, sizes.finals)
        verdicts = ch.open("verdicts", Verdict, sizes.verdicts)
        draft_commits = ch.open("draft_commits", Commit, sizes.commits)
        verify_commits = ch.open("verify_commits", Commit, sizes.commits)

        caches = await self.npu.run(  # units.py: copies start a team
            new_caches, request, self.prefixes, self.target, self.draft, self.config
        )
        jitter = _jitters(config)
        p = self.policies
        draft_policy = DraftPolicy(
            p.spec,
            p.cost,
            p.calibrator,
            ahead=config.draft_ahead,
            lookup=config.lookup,
            sampling=request.options.sampling,
        )
        drafter = Drafter(
            self.draft,
            draft_policy,
            request.prompt,
            caches[1],
            (self.cpu, self.npu),
            next(jitter),
            cached=request.reuse.tokens,
            view=request.draft_start,
            matcher=request.matcher.copy() if request.matcher else None,
        )
        verifier = Verifier(
            target,
            caches[0],
            p.exit_layer,
            self.npu,
            next(jitter),
            config.audit_every,
            p.probe_when,
            request.progress,
        )
        # the verifier's unit, idle while it awaits the verdict (the other may be drafting
        # ahead, on a pass flash paces)
        pruner = Pruner(p.prune, self.npu, next(jitter))
        projector = Projector(
            target.logits,
            self.npu if p.eager_projection else self.cpu,
            next(jitter),
            p.eager_projection,
            request.options.sampling,
            request.options.top_logprobs,
            request.matcher,
        )
        async with trio.open_nursery() as nursery:
            prefetcher = Prefetcher(target.store, target.plan, target.resident_layers)
            await nursery.start(prefetcher.run, releases.receive, layers.send)
            await nursery.start(
                drafter.run, DrafterInbox(requests.receive, draft_commits.receive), trees.send
            )
            await nursery.start(
                verifier.run,
                VerifierInbox(
                    trees.receive, layers.receive, prune_verdicts.receive, verify_commits.receive
                ),
                VerifierOutbox(releases.send, probes.send, finals.send),
            )
            await nursery.start(pruner.run, probes.receive, prune_verdicts.send)
            await nursery.start(projector.run, finals.receive, verdicts.send)
            with requests.send, draft_commits.send, verify_commits.send, verdicts.receive:
                await self._steps(
                    request,
                    events,
                    requests.send,
                    verdicts.receive,
                    (draft_commits.send, verify_commits.send),
                )
        # the actors have ended, so the caches hold what they kept: the text's prefix
        await self.npu.run(self.prefixes.store, request.text_tokens, *caches, request.draft_start)

    async def _steps(self, request, events, requests, verdicts, commits) -> None:
        """The engine's own loop: ask for a tree, take the verdict, emit, commit."""
        started = request.created
        decoder = (
            self.tokenizer.stream_decoder(skip_special=True, context=request.prompt[-1:])
            if self.tokenizer
            else None
        )
        tokenizer = self.tokenizer
        stop_ids = tokenizer.eos_ids if tokenizer else frozenset()
        previous = request.prompt[-1]  # the token a piece of text follows
        stops = StopText(request.options.stop, keep=request.options.keep_stop)
        phase = DecodePhase()
        reads = self.target.store.stats
        for step in range(request.options.max_new_tokens):
            step_started = time.perf_counter()
            bytes_before, read_seconds_before = reads.bytes_read, reads.read_seconds
            await requests.send(DraftRequest(step=step, max_nodes=self.spec.max_nodes))
            verdict: Verdict = await verdicts.receive()
            request.scope.deadline = math.inf  # from the first token on, the deadline is soft
            finish: FinishReason | None = None
            emitted = 0
            last = len(verdict.tokens)
            tops = verdict.top_logprobs or ((),) * last
            for token, from_draft, logprob, top in zip(
                verdict.tokens, verdict.from_draft, verdict.logprobs, tops, strict=True
            ):
                emitted += 1
                request.tokens.append(token)
                delta, stopped = stops.push(decoder.push(token) if decoder else "")
                piece = tokenizer.piece(token, previous) if tokenizer else ""
                alternatives = tuple(
                    TopLogprob(t, tokenizer.piece(t, previous) if tokenizer else "", lp)
                    for t, lp in top
                )
                previous = token
                if token in stop_ids or stopped:
                    finish = "stop"
                elif len(request.tokens) >= request.options.max_new_tokens:
                    finish = "length"
                elif emitted == last and request.past_deadline:
                    finish = "length"  # the step's tokens are all out; no step after it
                if finish is not None and not stopped:  # what is still held back ends here
                    more, cut = stops.push(decoder.flush() if decoder else "")
                    delta += more if cut else more + stops.flush()
                elapsed = time.perf_counter() - started
                phase.add(step, elapsed)
                event = TokenEvent(
                    token=token,
                    text=delta,
                    step=step,
                    from_draft=from_draft,
                    logprob=logprob,
                    prompt_tokens=len(request.prompt),
                    cached_tokens=request.reuse.tokens,
                    generated_tokens=len(request.tokens),
                    elapsed_seconds=elapsed,
                    tokens_per_second=phase.rate,
                    finish_reason=finish,
                    piece=piece,
                    top_logprobs=alternatives,
                )
                try:
                    with trio.fail_after(self.config.stall_seconds or math.inf):
                        await events.send(event)
                except trio.BrokenResourceError:
                    return  # the consumer stopped listening: the request ends here
                except trio.TooSlowError:
                    raise ConsumerStalledError(
                        f"no token was taken for {self.config.stall_seconds:g} s: the request "
                        "was ended, so that the next could run"
                    ) from None
                if finish is not None:
                    break
            stats = msgspec.structs.replace(
                verdict.stats,
                new_tokens=emitted,
                step_seconds=time.perf_counter() - step_started,
                bytes_read=reads.bytes_read - bytes_before,
                read_seconds=reads.read_seconds - read_seconds_before,
            )
            request.steps.append(stats)
            if self.policies.cost is not None:
                self.policies.cost.observe(stats)
            commit = Commit(step=step, accepted=verdict.accepted, next_tokens=verdict.tokens[-1:])
            for channel in commits:  # the last step's too: both caches keep its path
                await channel.send(commit)
            if finish is not None:
                return
            if self.target.plan.streams:
                # the step's freed temporaries (~150 MB held at steady state) back to the
                # kernel: short of memory they would crowd out the page cache. About a
                # millisecond on the event loop, 2% of a resident step, so only then.
                return_freed_heap()


AUTO = DramBudget("auto")
CHANNEL_CLOSED = (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError)


def _original(error: BaseException) -> BaseException:
    """The exception an actor raised, out of the groups the nurseries wrapped it in; a
    peer that merely saw its channel close because of it does not count."""
    while isinstance(error, BaseExceptionGroup):
        causes = [e for e in error.exceptions if not isinstance(e, CHANNEL_CLOSED)]
        if len(error.exceptions) == 1:
            error = error.exceptions[0]
        elif len(causes) == 1:
            error = causes[0]
        else:
            break
    return error


def _jitters(config: EngineConfig):
    seed = config.seed
    while True:
        seed += 1
        yield Jitter(config.jitter_seconds, seed)


def _check_same_vocabulary(target: FlashTarget, draft: DraftModel) -> None:
    """The target verifies the draft's token ids: both models must have as many tokens and,
    where both tokenizers are known, spell each id the same."""
    sizes = draft.model.args.vocab_size, target.args.vocab_size
    difference = ""  # compared where both tokenizers are known
    if draft.tokenizer is not None and target.tokenizer is not None:
        difference = _first_difference(draft.tokenizer, target.tokenizer)
    if sizes[0] != sizes[1] or difference:
        raise ConfigError(
            f"draft {draft.source} has {sizes[0]} tokens, the target {sizes[1]}{difference}: "
            "speculative decoding needs the same tokenizer"
        )


def _first_difference(draft: Tokenizer, target: Tokenizer) -> str:
    """'; first difference at id N: ...' for the lowest id the two spell differently, or
    that only one has; empty when they agree. Id by id: no copy of either vocabulary (two
    dicts of 150k tokens would cost 80 MB at start-up)."""
    ids = max(t.backend.get_vocab_size(with_added_tokens=True) for t in (draft, target))
    for i in range(ids):
        ours, theirs = draft.backend.id_to_token(i), target.backend.id_to_token(i)
        if ours != theirs:
            return (
                f"; first difference at id {i}: {_spelled(ours)} in the draft, "
                f"{_spelled(theirs)} in the target"
            )
    return ""


def _spelled(token: str | None) -> str:
    return "no token" if token is None else repr(token)


def memory_plan(
    config: EngineConfig,
    manifest: Manifest,
    *,
    process: int,
    draft: int,
    draft_kv_bytes_per_token: int = 0,
    context_tokens: int | None = None,
    budget: DramBudget | None = None,
) -> MemoryPlan:
    """The memory plan (memory_plan.py) for this config's target, or `budget`, beside
    `process` and `draft` bytes held, with room for `context_tokens` (default: ctx_size,
    else AUTO_CONTEXT or the model's, if less)."""
    if context_tokens is None:
        context_tokens = config.ctx_size or min(AUTO_CONTEXT, manifest.args.max_seq_len)
    return plan_memory(
        budget or config.dram_budget,
        manifest.file_bytes,
        minimum_budget(manifest, config.ring_slots),
        limit=memory_limit_bytes(),
        process=process,
        draft=draft,
        libraries=file_rss_bytes(),
        kv_bytes_per_token=position_bytes(manifest.args, manifest.torch_dtype)
        + draft_kv_bytes_per_token,
        context_tokens=context_tokens,
    )


def _open_target(config: EngineConfig, plan: ResidencyPlan) -> FlashTarget:
    return FlashTarget(
        Path(config.target), plan, throttle=config.throttle, verify=config.verify_checksums
    )
