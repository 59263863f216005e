"""The actors every request shares: the prefetcher, the verifier and the pruner serve the
whole batch (batch.py) while it has requests, so that a layer read once is applied to
every request's tree, and the next pass's reads go on while a request leaves and another
joins. An idle engine reads nothing and holds no ring slots. Where one of them fails,
every request in the batch ends with its error; the next request starts a new crew."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import trio

from lever_actors.actors.jitter import Jitter
from lever_actors.actors.prefetcher import Prefetcher
from lever_actors.actors.pruner import Pruner
from lever_actors.actors.verifier import Arrival, Verifier, VerifierInbox, VerifierOutbox
from lever_actors.channels.bounded import ChannelSet
from lever_actors.channels.messages import (
    ExitProbe,
    LayerWeights,
    PruneVerdict,
    SlotRelease,
)
from lever_actors.channels.trace import Tracer
from lever_actors.config import EngineConfig
from lever_actors.device.units import ComputeUnit
from lever_actors.engine.batch import Batch, Place
from lever_actors.engine.switching import PlanSwitch
from lever_actors.policy.schedule import PrefillChunks
from lever_actors.policy.setup import Policies
from lever_actors.target import FlashTarget

# a request's messages to the verifier that may be in flight at once: its seat, its tree or
# a draft forward (one at a time), its stepping aside, and its leaving, so that leaving
# never waits
ARRIVALS_PER_REQUEST = 4


class Crew:
    """The actors every request shares, and the end their requests' trees go to."""

    def __init__(
        self,
        batch: Batch,
        config: EngineConfig,
        target: FlashTarget,
        policies: Policies,
        switch: PlanSwitch,
        npu: ComputeUnit,
        tracer: Tracer | None,
    ) -> None:
        self.batch, self.config, self.target, self.policies = batch, config, target, policies
        self.switch = switch  # whether requests still draft, and the change when they stop
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
        jitter = jitters(config)
        prefetcher = Prefetcher(target.store, target.plan, target.resident_layers)
        verifier = Verifier(
            target,
            p.exit_layer,
            self.npu,
            next(jitter),
            config.audit_every,
            p.probe_when,
            project_chains=not p.eager_projection,
            chunks=PrefillChunks(_pass_compute_seconds(p), pass_seconds=_pass_seconds(p)),
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


def _pass_compute_seconds(p: Policies) -> Callable[[int], float] | None:
    """A pass's compute by its rows, as the cost model prices it (None without one)."""
    cost = p.cost
    return None if cost is None else cost.pass_compute_seconds


def _pass_seconds(p: Policies) -> Callable[[int], float] | None:
    """A pass's time by its rows, reads and head included, as the cost model prices it."""
    cost = p.cost
    return None if cost is None else lambda rows: cost.step_seconds(rows, [], 1.0)


def jitters(config: EngineConfig, stream: int = 0) -> Iterator[Jitter]:
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
