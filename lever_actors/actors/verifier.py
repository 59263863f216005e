"""The verifier actor: runs the flash-resident target over the whole tree, layer by layer."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import trio

from lever_actors.actors.jitter import Jitter
from lever_actors.channels.messages import (
    Commit,
    DraftTree,
    ExitProbe,
    FinalHidden,
    LayerWeights,
    PruneVerdict,
    SlotRelease,
)
from lever_actors.device.units import ComputeUnit
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.layers import layers_forward
from lever_actors.model.placement import Placement, tree_placement
from lever_actors.model.tree import TokenTree
from lever_actors.policy.pruning import ProbeWhen, always
from lever_actors.progress import Progress
from lever_actors.target import FlashTarget

# committed tokens from which a pass counts as a prefill that reports progress
PREFILL_SHOWN = 256


@dataclass
class VerifierInbox:
    trees: trio.MemoryReceiveChannel[DraftTree]
    layers: trio.MemoryReceiveChannel[LayerWeights]
    prune_verdicts: trio.MemoryReceiveChannel[PruneVerdict]
    commits: trio.MemoryReceiveChannel[Commit]


@dataclass
class VerifierOutbox:
    releases: trio.MemorySendChannel[SlotRelease]
    probes: trio.MemorySendChannel[ExitProbe]
    finals: trio.MemorySendChannel[FinalHidden]


class Verifier:
    """One tree per step: the layers are applied to the live nodes as they arrive (those
    already queued in one job) and a layer's slot released as soon as it is applied. At
    the exit layer the pruner may drop nodes; they and their descendants skip the
    remaining layers. The target's KV cache (the request's, which may start from a reused
    prefix) keeps the accepted path."""

    def __init__(
        self,
        target: FlashTarget,
        cache: KVCache,
        exit_layer: int | None,
        unit: ComputeUnit,
        jitter: Jitter,
        audit_every: int = 0,
        probe_when: ProbeWhen = always,
        progress: Progress | None = None,
    ) -> None:
        self.target = target
        self.cache = cache
        self.exit_layer = exit_layer  # None: no probes, the pruner is out of the loop
        self.probe_when = probe_when  # tree nodes -> whether this pass probes at exit_layer
        self.unit = unit
        self.jitter = jitter
        self.audit_every = audit_every  # every n-th step the pruner's drops still run in full
        self.progress = progress  # hears of a long prefill's layers, as prompt tokens done

    async def run(
        self,
        inbox: VerifierInbox,
        outbox: VerifierOutbox,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with inbox.trees, inbox.layers, inbox.prune_verdicts, inbox.commits:
            with outbox.releases, outbox.probes, outbox.finals:
                task_status.started()
                kept: list[int] | None = None  # the last step's accepted path, not yet kept
                async for message in inbox.trees:
                    await self.jitter()
                    final = await self._verify(message, kept, inbox, outbox)
                    await outbox.finals.send(final)
                    try:
                        commit = await inbox.commits.receive()
                    except trio.EndOfChannel:
                        return
                    kept = list(commit.accepted)  # kept in the next pass's first job
                if kept is not None:  # the last step's too, for the prefix cache
                    await self.unit.run(self.cache.keep, kept)

    async def _verify(
        self,
        message: DraftTree,
        kept: list[int] | None,
        inbox: VerifierInbox,
        outbox: VerifierOutbox,
    ):
        target, cache = self.target, self.cache
        n_layers = target.args.n_layers
        tree = TokenTree(message.tokens, message.parents)
        x: torch.Tensor  # x and place: set by the pass's first job
        place: Placement
        context = 0
        live = list(range(len(tree)))
        probes = (
            self.exit_layer is not None
            and len(tree) > message.n_committed
            and self.probe_when(len(tree))
        )
        probe_at = self.exit_layer if probes else None  # the layer this pass probes at
        audit = False
        would_drop: tuple[int, ...] = ()
        io_wait = compute = probe_seconds = 0.0
        layer = 0
        while layer < n_layers:
            # up to the exit layer first when this pass probes there: the pruner's verdict
            # decides which nodes go on
            last = probe_at if probe_at is not None and layer <= probe_at else n_layers - 1
            waited = time.perf_counter()
            arrived = await self._layers_arrived(inbox.layers, message.step, layer, last)
            started = time.perf_counter()
            tensors = [weights.tensors for weights in arrived]
            # the jobs' own time: a wait behind a round drafted ahead on the unit is no cost
            # of the tree's nodes
            if layer == 0:  # one job, not three: each hands over between threads (units.py)
                (x, place, context), seconds = await self.unit.run_timed(
                    _first_layers, target, tree, cache, kept, tensors
                )
            else:
                x, seconds = await self.unit.run_timed(
                    _apply_layers, x, torch.tensor(live), tensors, target.args, cache, layer, place
                )
            io_wait += started - waited
            compute += seconds
            for weights in arrived:
                if weights.slot is not None:
                    await outbox.releases.send(SlotRelease(step=message.step, slot=weights.slot))
            layer += len(arrived)
            if self.progress is not None and message.n_committed >= PREFILL_SHOWN:
                done = message.n_committed * layer // n_layers
                self.progress(done, message.n_committed, "prefill")
            if layer - 1 == probe_at:
                asked = time.perf_counter()
                kept = await self._prune(message, tree, live, x, layer - 1, inbox, outbox)
                probe_seconds = time.perf_counter() - asked
                audit = bool(self.audit_every) and message.step % self.audit_every == 0
                if audit:
                    would_drop = tuple(n for n in live if n not in kept)  # run them anyway
                else:
                    live = kept
        pruned = len(tree) - len(live)
        return FinalHidden(
            step=message.step,
            tree=message,
            position=context,
            nodes=tuple(live),
            hidden=await self._rows(x, live),
            io_wait_seconds=io_wait,
            verify_seconds=compute,
            pruned=pruned,
            saved_node_layers=pruned * (n_layers - 1 - (self.exit_layer or 0)),
            probe_seconds=probe_seconds,
            audit=audit,
            would_drop=would_drop,
        )

    async def _rows(self, x: torch.Tensor, live: list[int]) -> torch.Tensor:
        """x's rows `live`: all of x as it is, a subset gathered on the unit (units.py)."""
        if live == list(range(x.shape[0])):
            return x
        return await self.unit.run(x.__getitem__, torch.tensor(live))

    @staticmethod
    async def _layers_arrived(
        layers: trio.MemoryReceiveChannel[LayerWeights], step: int, first: int, last: int
    ) -> list[LayerWeights]:
        """Layer `first` of this step (waiting for it), then those after it up to `last` that
        have already arrived, until one holds a slot: applied in one job, since a job per
        layer cost about 1 ms of thread handoff each (a resident 1-row pass, 28 layers:
        127-135 ms against 100). A job holds at most one slot, so the prefetcher can read
        into the other meanwhile."""
        arrived = [await layers.receive()]
        while arrived[-1].layer < last and arrived[-1].slot is None:
            try:
                arrived.append(layers.receive_nowait())
            except trio.WouldBlock:
                break
        for expected, weights in enumerate(arrived, start=first):
            if (weights.step, weights.layer) != (step, expected):
                raise RuntimeError(
                    f"verifier expected layer {expected} of step {step}, got layer "
                    f"{weights.layer} of step {weights.step}"
                )
        return arrived

    async def _prune(
        self,
        message: DraftTree,
        tree: TokenTree,
        live: list[int],
        x: torch.Tensor,
        layer: int,
        inbox: VerifierInbox,
        outbox: VerifierOutbox,
    ) -> list[int]:
        hidden = await self._rows(x, live)
        await outbox.probes.send(
            ExitProbe(
                step=message.step, tree=message, layer=layer, nodes=tuple(live), hidden=hidden
            )
        )
        verdict = await inbox.prune_verdicts.receive()
        # committed tokens are never dropped: their KV entries must reach the cache
        dropped = [n for n in verdict.dropped if n >= message.n_committed]
        alive = tree.without(dropped)
        return [n for n in live if alive[n]]


def _first_layers(
    target: FlashTarget, tree: TokenTree, cache, kept: list[int] | None, layers: list
) -> tuple[torch.Tensor, Placement, int]:
    """A pass's first job: the last step's accepted path kept in the KV cache, the tree
    embedded and placed after it (its masks on the unit too: a prompt's are large), and the
    first `layers` applied. Returns x [n, d_model], the placement and the context length."""
    if kept is not None:
        cache.keep(kept)
    context = cache.length
    x = target.embed(list(tree.tokens))
    place = tree_placement(target.rope, context, tree, target.dtype)
    index = torch.arange(len(tree))
    return _apply_layers(x, index, layers, target.args, cache, 0, place), place, context


def _apply_layers(x, index, layers, args, cache, first, place) -> torch.Tensor:
    """x: [n, d_model] for the whole tree placed at `place`; only rows `index` advance
    through `layers`, the target's layers first, first + 1, ..."""
    everyone = len(index) == x.shape[0]
    rows = x if everyone else x[index]
    if not everyone:  # the whole tree keeps its placement: cache writes stay slices
        place = place.rows(index)
    rows = layers_forward(rows, layers, args, cache, first, place)
    if everyone:
        return rows
    out = x.clone()
    out[index] = rows
    return out
