"""One request's actors and channels: the engine's only wiring.

The five actors run in a nursery of the request's own, so that a request that ends early
takes every actor and channel with it. The request's KV caches start from the prefix
cache and go back to it, holding the text's prefix, once the actors have ended."""

from __future__ import annotations

from collections.abc import Iterator

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
    LayerWeights,
    PruneVerdict,
    SlotRelease,
    TokenEvent,
    Verdict,
)
from lever_actors.config import EngineConfig
from lever_actors.device.units import ComputeUnit
from lever_actors.model.transformer import Transformer
from lever_actors.policy.setup import Policies
from lever_actors.prefix_cache import PrefixCache
from lever_actors.sequences import Request, new_caches
from lever_actors.steps import run_steps
from lever_actors.target import FlashTarget


async def run_actors(
    request: Request,
    events: trio.MemorySendChannel[TokenEvent],
    ch: ChannelSet,
    config: EngineConfig,
    target: FlashTarget,
    draft: Transformer | None,
    policies: Policies,
    units: tuple[ComputeUnit, ComputeUnit],  # "npu", "cpu"
    prefixes: PrefixCache,
) -> None:
    """Run `request` to its end on channels opened in `ch`, its events sent to `events`."""
    npu, cpu = units
    sizes = config.channels
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

    caches = await npu.run(  # units.py: copies start a team
        new_caches, request, prefixes, target, draft, config
    )
    jitter = _jitters(config)
    p = policies
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
        caches[1],
        (cpu, npu),
        next(jitter),
        cached=request.reuse.tokens,
        view=request.draft_start,
        matcher=request.matcher.copy() if request.matcher else None,
    )
    verifier = Verifier(
        target,
        caches[0],
        p.exit_layer,
        npu,
        next(jitter),
        config.audit_every,
        p.probe_when,
        request.progress,
    )
    # the verifier's unit, idle while it awaits the verdict (the other may be drafting
    # ahead, on a pass flash paces)
    pruner = Pruner(p.prune, npu, next(jitter))
    projector = Projector(
        target.logits,
        npu if p.eager_projection else cpu,
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
            await run_steps(
                request,
                events,
                requests.send,
                verdicts.receive,
                (draft_commits.send, verify_commits.send),
                target,
                policies,
                config.stall_seconds,
            )
    # the actors have ended, so the caches hold what they kept: the text's prefix
    await npu.run(prefixes.store, request.text_tokens, *caches, request.draft_start)


def _jitters(config: EngineConfig) -> Iterator[Jitter]:
    seed = config.seed
    while True:
        seed += 1
        yield Jitter(config.jitter_seconds, seed)
