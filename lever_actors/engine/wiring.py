"""A request's own actors, wired to the crew it joins (crew.py): its drafter, projector
and step loop run in a nursery of its own, so that a request that ends early takes them
and its channels with it. Its KV caches start from the prefix cache and go back to it,
holding the text's prefix, once the verifier lets go."""

from __future__ import annotations

import contextlib
from functools import partial

import trio

from lever_actors.actors.drafter import Drafter, DrafterInbox, DraftPolicy
from lever_actors.actors.projector import Projector
from lever_actors.actors.verifier import Arrival
from lever_actors.channels.bounded import ChannelSet
from lever_actors.channels.messages import (
    Commit,
    DraftRequest,
    DraftRound,
    FinalHidden,
    LeaveSeat,
    TakeSeat,
    TokenEvent,
    Verdict,
)
from lever_actors.device.units import ComputeUnit
from lever_actors.engine.batch import Place
from lever_actors.engine.crew import Crew, jitters
from lever_actors.engine.prefix_cache import PrefixCache
from lever_actors.engine.state import RequestState, new_caches
from lever_actors.engine.steps import run_steps
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.transformer import Transformer
from lever_actors.policy.trees import Round


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

    target_cache, draft_cache = await npu.run(  # units.py: copies start a team
        new_caches, request, prefixes, target, draft, config, crew.batch.free_tokens
    )
    leaving = LeaveSeat(step=-1, seat=place.seat, done=trio.Event())
    left = False
    with await crew.join(place) as arrivals:
        drafter, projector = _own_actors(request, place, crew, draft_cache, draft, units, arrivals)
        # the drafter alone holds the draft and its KV: it lets go of them where the plan
        # gives way to copies (engine/switching.py)
        draft = draft_cache = None
        seat = TakeSeat(
            step=-1,
            seat=place.seat,
            cache=target_cache,
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
                        arrivals,
                        requests.send,
                        verdicts.receive,
                        (draft_commits.send, verify_commits.send),
                        target,
                        p,
                        crew.switch,
                        drafter.model is not None,
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
    await npu.run(  # its place still held: the copy lies beside its KV
        prefixes.store,
        request.text_tokens,
        target_cache,
        drafter.cache,
        request.draft_start,
        crew.batch.free_tokens,
    )


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
    jitter = jitters(config, 2 + place.seat)
    draft_policy = DraftPolicy(
        p.spec,
        p.cost,
        p.calibrator,
        ahead=config.draft_ahead,
        lookup=config.lookup,
        sampling=request.options.sampling,
        copies_from=crew.switch.copies_from,
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
