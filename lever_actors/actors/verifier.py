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
from lever_actors.model.layers import layer_forward
from lever_actors.model.placement import tree_placement
from lever_actors.model.tree import TokenTree
from lever_actors.policy.pruning import ProbeWhen, always
from lever_actors.target import FlashTarget


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
    """One tree per step: each layer is applied to the live nodes as soon as it arrives and
    its slot released at once. At the exit layer the pruner may drop nodes; they and their
    descendants skip the remaining layers. The target's KV cache keeps the accepted path."""

    def __init__(
        self,
        target: FlashTarget,
        capacity: int,
        exit_layer: int | None,
        unit: ComputeUnit,
        jitter: Jitter,
        audit_every: int = 0,
        probe_when: ProbeWhen = always,
    ) -> None:
        self.target = target
        self.capacity = capacity
        self.exit_layer = exit_layer  # None: no probes, the pruner is out of the loop
        self.probe_when = probe_when  # tree nodes -> whether this pass probes at exit_layer
        self.unit = unit
        self.jitter = jitter
        self.audit_every = audit_every  # every n-th step the pruner's drops still run in full

    async def run(
        self,
        inbox: VerifierInbox,
        outbox: VerifierOutbox,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with inbox.trees, inbox.layers, inbox.prune_verdicts, inbox.commits:
            with outbox.releases, outbox.probes, outbox.finals:
                cache = self.target.new_cache(self.capacity)
                task_status.started()
                async for message in inbox.trees:
                    await self.jitter()
                    final = await self._verify(message, cache, inbox, outbox)
                    await outbox.finals.send(final)
                    try:
                        commit = await inbox.commits.receive()
                    except trio.EndOfChannel:
                        return
                    cache.keep(list(commit.accepted))

    async def _verify(
        self, message: DraftTree, cache, inbox: VerifierInbox, outbox: VerifierOutbox
    ):
        target = self.target
        tree = TokenTree(message.tokens, message.parents)
        context = cache.length
        place = tree_placement(target.rope, context, tree, target.dtype)
        x = await self.unit.run(target.embed, list(tree.tokens))  # [n, d_model]
        live = list(range(len(tree)))
        audit, would_drop = False, ()
        io_wait = compute = 0.0
        for layer in range(target.args.n_layers):
            waited = time.perf_counter()
            weights = await inbox.layers.receive()
            started = time.perf_counter()
            if (weights.step, weights.layer) != (message.step, layer):
                raise RuntimeError(
                    f"verifier expected layer {layer} of step {message.step}, got layer "
                    f"{weights.layer} of step {weights.step}"
                )
            index = torch.tensor(live)
            x = await self.unit.run(
                _apply_layer,
                x,
                index,
                weights.tensors,
                target.args,
                cache,
                layer,
                place.rows(index),
            )
            io_wait += started - waited
            compute += time.perf_counter() - started
            if weights.slot is not None:
                await outbox.releases.send(SlotRelease(step=message.step, slot=weights.slot))
            if (
                layer == self.exit_layer
                and len(tree) > message.n_committed
                and self.probe_when(len(tree))
            ):
                kept = await self._prune(message, tree, live, x, layer, inbox, outbox)
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
            hidden=x[live],
            io_wait_seconds=io_wait,
            verify_seconds=compute,
            pruned=pruned,
            saved_node_layers=pruned * (target.args.n_layers - 1 - (self.exit_layer or 0)),
            audit=audit,
            would_drop=would_drop,
        )

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
        await outbox.probes.send(
            ExitProbe(
                step=message.step, tree=message, layer=layer, nodes=tuple(live), hidden=x[live]
            )
        )
        verdict = await inbox.prune_verdicts.receive()
        # committed tokens are never dropped: their KV entries must reach the cache
        dropped = [n for n in verdict.dropped if n >= message.n_committed]
        alive = tree.without(dropped)
        return [n for n in live if alive[n]]


def _apply_layer(x, index, weights, args, cache, layer, place) -> torch.Tensor:
    """x: [n, d_model] for the whole tree; only rows `index` advance through this layer."""
    if len(index) == x.shape[0]:
        return layer_forward(x, weights, args, cache, layer, place)
    out = x.clone()
    out[index] = layer_forward(x[index], weights, args, cache, layer, place)
    return out
