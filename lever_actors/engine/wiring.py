"""The engine's only wiring: the actors every request shares, and each request's own.

The prefetcher, the verifier and the pruner serve the whole batch (batch.py) while it has
requests: a layer read once is applied to every request's tree, and the next pass's reads
go on while a request leaves and another joins. An idle engine reads nothing and holds no
ring slots. Where one of them fails, every request in the batch ends with its error; the
next request starts a new crew.

A request's drafter, projector and step loop run in a nursery of its own, so that a
request that ends early takes them and its channels with it. Its KV caches start from the
prefix cache and go back to it, holding the text's prefix, once the verifier lets go."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any

import trio

from lever_actors.actors.drafter import Drafter, DrafterInbox, DraftPolicy
from lever_actors.actors.jitter import Jitter
from lever_actors.actors.prefetcher import Prefetcher
from lever_actors.actors.projector import Projector
from lever_actors.actors.pruner import Pruner
from lever_actors.actors.verifier import Arrival, Verifier, VerifierInbox, VerifierOutbox
from lever_actors.channels.bounded import ChannelSet
from lever_actors.channels.messages import (
    Commit,
    DraftRequest,
    DraftRound,
    ExitProbe,
    FinalHidden,
    LayerWeights,
    LeaveSeat,
    PruneVerdict,
    SlotRelease,
    TakeSeat,
    TokenEvent,
    Verdict,
)
from lever_actors.channels.trace import Tracer
from lever_actors.config import EngineConfig
from lever_actors.device.units import ComputeUnit
from lever_actors.engine.batch import Batch, Place
from lever_actors.engine.prefix_cache import PrefixCache
from lever_actors.engine.state import RequestState, new_caches
from lever_actors.engine.steps import run_steps
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.transformer import Transformer
from lever_actors.policy.setup import Policies
from lever_actors.policy.trees import Round
from lever_actors.target import FlashTarget

# a request's messages to the verifier that may be in flight at once: its seat, its tree or
# a draft forward (one at a time), and its leaving, so that leaving never waits
ARRIVALS_PER_REQUEST = 3


class Crew:
    """The actors every request shares, and the end their requests' trees go to."""

    def __init__(
        self,
        batch: Batch,
        config: EngineConfig,
        target: FlashTarget,
        policies: Policies,
        npu: ComputeUnit,
        tracer: Tracer | None,
    ) -> None:
        self.batch, self.config, self.target, self.policies = batch, config, target, policies
        self.npu, self.tracer = npu, tracer
        self.channels: ChannelSet | None = None  # the latest crew's
        self._arrivals: trio.MemorySendChannel[Arrival] | None = None  # to its verifier
        self._running = trio.Event()
        self._ended = trio.Event()  # the latest crew's
        self._ended.set()

    async def run(self) -> None:
        """For the engine's life: a crew while the batch has requests."""
        while True:
            await self.batch.occupied()
            ended = self._ended = trio.Event()
            try:
                async with trio.open_nursery() as nursery:
                    with await self._start(nursery) as self._arrivals:  # the requests clone it
                        self._running.set()
                        await self.batch.emptied()
                        self._close_doors()
                        nursery.cancel_scope.cancel()
            except* Exception as group:  # a guarded actor's was told at once; any other now
                self._close_doors()
                self.batch.fail(original(group), ended)
            finally:
                ended.set()

    async def ended(self) -> None:
        """Return once the latest crew has ended, its threads too."""
        await self._ended.wait()

    async def join(self, place: Place) -> trio.MemorySendChannel[Arrival]:
        """A placed request's end of the verifier's arrivals, once a crew runs; the place
        belongs to that crew from then on."""
        await self._running.wait()
        assert self._arrivals is not None  # set before `running`
        place.crew = self._ended
        return self._arrivals.clone()

    def _close_doors(self) -> None:
        """No request joins this crew from now on: it is ending."""
        self._arrivals, self._running = None, trio.Event()

    async def _guard(
        self,
        run: Callable[..., Awaitable[None]],
        inbox: Any,
        outbox: Any,
        *,
        task_status: trio.TaskStatus[None],
    ) -> None:
        """Run an actor of the crew; where it fails, before anything else runs, no request
        joins the crew any more and those that joined it end with its error."""
        crew = self._ended
        try:
            await run(inbox, outbox, task_status=task_status)
        except Exception as error:
            self._close_doors()
            self.batch.fail(original(error), crew)
            raise

    async def _start(self, nursery: trio.Nursery) -> trio.MemorySendChannel[Arrival]:
        """Start the actors; returns the send end of the verifier's arrivals."""
        config, target, p = self.config, self.target, self.policies
        ch = self.channels = ChannelSet(self.tracer)
        capacity = ARRIVALS_PER_REQUEST * self.batch.parallel
        arrivals = ch.open("arrivals", Arrival, capacity)
        # room for the resident layers too: queued, they cost no memory, and the verifier
        # applies the layers that have arrived in one job
        slots = max(target.plan.ring_slots, 1)
        layers = ch.open("layers", LayerWeights, slots + len(target.resident_layers))
        releases = ch.open("releases", SlotRelease, slots)
        probes = ch.open("probes", ExitProbe, config.channels.probes)
        prune_verdicts = ch.open("prune_verdicts", PruneVerdict, config.channels.prune_verdicts)
        jitter = _jitters(config)
        prefetcher = Prefetcher(target.store, target.plan, target.resident_layers)
        verifier = Verifier(
            target,
            p.exit_layer,
            self.npu,
            next(jitter),
            config.audit_every,
            p.probe_when,
            project_chains=not p.eager_projection,
        )
        # the verifier's unit, idle while it awaits the verdict; the policy is looked up at
        # each probe, since the crew outlives a swap (the engine's close lets go of the lens)
        pruner = Pruner(lambda probe: p.prune(probe), self.npu, next(jitter))
        await nursery.start(self._guard, prefetcher.run, releases.receive, layers.send)
        await nursery.start(
            self._guard,
            verifier.run,
            VerifierInbox(arrivals.receive, layers.receive, prune_verdicts.receive),
            VerifierOutbox(releases.send, probes.send),
        )
        await nursery.start(self._guard, pruner.run, probes.receive, prune_verdicts.send)
        return arrivals.send


async def run_request(
    request: RequestState,
    place: Place,
    crew: Crew,
    events: trio.MemorySendChannel[TokenEvent],
    ch: ChannelSet,
    draft: Transformer | None,
    units: tuple[ComputeUnit, ComputeUnit],  # "npu", "cpu"
    prefixes: PrefixCache,
) -> None:
    """Run `request` to its end in its place in the batch, on channels opened in `ch`, its
    events sent to `events`."""
    config, target, p = crew.config, crew.target, crew.policies
    npu = units[0]
    sizes = config.channels
    requests = ch.open("requests", DraftRequest, sizes.requests)
    finals = ch.open("finals", FinalHidden, sizes.finals)
    verdicts = ch.open("verdicts", Verdict, sizes.verdicts)
    draft_commits = ch.open("draft_commits", Commit, sizes.commits)
    verify_commits = ch.open("verify_commits", Commit, sizes.commits)

    caches = await npu.run(  # units.py: copies start a team
        new_caches, request, prefixes, target, draft, config
    )
    leaving = LeaveSeat(step=-1, seat=place.seat, done=trio.Event())
    left = False
    with await crew.join(place) as arrivals:
        drafter, projector = _own_actors(request, place, crew, caches[1], draft, units, arrivals)
        seat = TakeSeat(
            step=-1,
            seat=place.seat,
            cache=caches[0],
            commits=verify_commits.receive,
            finals=finals.send,
            progress=request.progress,
        )
        await arrivals.send(seat)  # the verifier owns the ends it names from here
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    drafter.run,
                    DrafterInbox(requests.receive, draft_commits.receive),
                    arrivals.clone(),
                )
                await nursery.start(projector.run, finals.receive, verdicts.send)
                with requests.send, draft_commits.send, verify_commits.send, verdicts.receive:
                    await run_steps(
                        request,
                        place,
                        crew.batch,
                        events,
                        requests.send,
                        verdicts.receive,
                        (draft_commits.send, verify_commits.send),
                        target,
                        p,
                        config.stall_seconds,
                    )
                left = True  # the verifier then closes the projector's inbox, which ends it
                await _leave(arrivals, leaving)
        finally:
            if not left:
                await _leave(arrivals, leaving)
                # its place, and the KV room it holds, are free once the verifier lets go
                # of its cache (or its crew ends): at most the end of the pass
                with trio.CancelScope(shield=True):
                    await _first_of(leaving.done, place.crew)
    await leaving.done.wait()  # the verifier has kept the last accepted path
    place.crew = None  # no failure of the crew concerns it now
    await npu.run(prefixes.store, request.text_tokens, *caches, request.draft_start)


def _own_actors(
    request: RequestState,
    place: Place,
    crew: Crew,
    draft_cache: KVCache | None,
    draft: Transformer | None,
    units: tuple[ComputeUnit, ComputeUnit],
    arrivals: trio.MemorySendChannel[Arrival],
) -> tuple[Drafter, Projector]:
    """A request's drafter, whose forwards the verifier runs with the batch's others, and
    its projector."""
    config, target, p = crew.config, crew.target, crew.policies
    npu, cpu = units
    jitter = _jitters(config, 2 + place.seat)
    draft_policy = DraftPolicy(
        p.spec,
        p.cost,
        p.calibrator,
        ahead=config.draft_ahead,
        lookup=config.lookup,
        sampling=request.options.sampling,
    )
    drafter = Drafter(
        draft,
        draft_policy,
        request.prompt,
        draft_cache,
        (cpu, npu),
        next(jitter),
        cached=request.reuse.tokens,
        view=request.draft_start,
        matcher=request.matcher.copy() if request.matcher else None,
        seat=place.seat,
        rounds=partial(_draft_round, arrivals, place.seat),
    )
    projector = Projector(
        target.logits,
        npu if p.eager_projection else cpu,
        next(jitter),
        p.eager_projection,
        request.options.sampling,
        request.options.top_logprobs,
        request.matcher,
    )
    return drafter, projector


async def _draft_round(arrivals: trio.MemorySendChannel[Arrival], seat: int, round: Round) -> None:
    """A draft forward, run by the verifier with those of the batch's other requests."""
    done = trio.Event()
    await arrivals.send(DraftRound(step=-1, seat=seat, round=round, done=done))
    await done.wait()
    if round.error is not None:
        raise round.error


async def _first_of(*events: trio.Event | None) -> None:
    """Return once one of `events` is set."""
    async with trio.open_nursery() as nursery:

        async def wait(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        for event in events:
            if event is not None:
                nursery.start_soon(wait, event)


async def _leave(arrivals: trio.MemorySendChannel[Arrival], message: LeaveSeat) -> None:
    """Tell the verifier, even from a cancelled request: there is room for it
    (ARRIVALS_PER_REQUEST), unless requests came and went in one long pass; a crew that
    failed has nobody to tell."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        try:
            arrivals.send_nowait(message)
        except trio.WouldBlock:
            with trio.CancelScope(shield=True):  # until the verifier's pass ends
                await arrivals.send(message)


def _jitters(config: EngineConfig, stream: int = 0) -> Iterator[Jitter]:
    """Each actor's own random sleeps: the crew's from the config's seed, a request's from
    its seat's (`stream`), so that no two actors share a sequence."""
    seed = config.seed + 1000 * stream
    while True:
        seed += 1
        yield Jitter(config.jitter_seconds, seed)


CHANNEL_CLOSED = (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError)


def original(error: BaseException) -> BaseException:
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
