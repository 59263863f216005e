"""The verifier actor: runs the flash-resident target over the trees of every request in
the batch, layer by layer, each arriving layer applied to all their rows in one job; and,
between passes, the draft forwards of the requests still drafting, together. When a pass
or a job of draft rounds is ready, and how much of a joining request's prompt a pass takes
beside the requests already decoding, are the scheduler's decisions (policy/schedule.py
Passes, PrefillChunks); the verifier runs what it is given."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import trio

from lever_actors.actors.jitter import Jitter
from lever_actors.channels.messages import (
    Commit,
    DraftRound,
    DraftTree,
    ExitProbe,
    FinalHidden,
    LayerWeights,
    LeaveSeat,
    PruneVerdict,
    SlotRelease,
    StepAside,
    TakeSeat,
)
from lever_actors.device.units import ComputeUnit
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.layers import Block, batch_layers_forward
from lever_actors.model.placement import Placement, tree_placement
from lever_actors.model.tree import TokenTree
from lever_actors.model.weights import LayerTensors
from lever_actors.policy.pruning import ProbeWhen, always
from lever_actors.policy.schedule import Passes, PrefillChunks, chunk_end
from lever_actors.policy.trees import run_rounds
from lever_actors.progress import Progress
from lever_actors.target import FlashTarget

# committed tokens from which a pass counts as a prefill that reports progress
PREFILL_SHOWN = 256
# a pass of more rows (a prompt's) takes its layers a job each, so that a request that
# leaves (its deadline passed) stops at the next layer (a thread handoff a layer, some 28 ms
# of a pass of a second or more); fewer share a job (_layers_arrived)
LAYER_A_JOB_ROWS = 256
# what a request sends the verifier: its comings and goings, its draft forwards, its trees
Arrival = DraftTree | DraftRound | TakeSeat | LeaveSeat | StepAside


@dataclass
class VerifierInbox:
    arrivals: trio.MemoryReceiveChannel[Arrival]
    layers: trio.MemoryReceiveChannel[LayerWeights]
    prune_verdicts: trio.MemoryReceiveChannel[PruneVerdict]


@dataclass
class VerifierOutbox:
    releases: trio.MemorySendChannel[SlotRelease]
    probes: trio.MemorySendChannel[ExitProbe]


@dataclass
class Occupant:
    """The request in a seat of the batch (a seat is a number: engine/batch.py Place.seat):
    its target cache and channel ends, and the accepted path of its last tree, kept in the
    cache by its next pass's first job."""

    cache: KVCache
    commits: trio.MemoryReceiveChannel[Commit]
    finals: trio.MemorySendChannel[FinalHidden]
    progress: Progress | None
    awaiting_commit: bool = False  # its last tree's commit not yet taken
    kept: list[int] | None = None

    @classmethod
    def taken(cls, message: TakeSeat) -> Occupant:
        return cls(message.cache, message.commits, message.finals, message.progress)

    async def take_commit(self) -> None:
        """Its last tree's accepted path, once the engine has committed it (none if the
        request ended without)."""
        if self.awaiting_commit:
            self.awaiting_commit = False
            try:
                self.kept = list((await self.commits.receive()).accepted)
            except trio.EndOfChannel:
                self.kept = None

    def close(self) -> None:
        self.commits.close()
        self.finals.close()


def _has_left(occupant: Occupant) -> bool:
    """Whether the occupant's request has ended: its projector no longer listens."""
    return occupant.finals.statistics().open_receive_channels == 0


@dataclass
class _Tree:
    """One request's tree in a pass, and where the pass has taken it. A joining request's
    prompt may take several passes, a chunk of its nodes each (start to end), their KV
    written to the cache's pending block; the last one takes the rest of the tree."""

    seat: int
    occupant: Occupant
    message: DraftTree
    tree: TokenTree
    start: int = 0  # its first node in this pass: those before it went through earlier ones
    end: int = 0  # one past its last node in this pass
    passes: int = 0  # the passes it has been in
    probes: bool = False  # whether the pass probes it at the exit layer
    live: list[int] = field(default_factory=list)  # its nodes still going through the layers
    x: torch.Tensor | None = None  # [end - start, d_model]: set by the pass's first job
    whole: Placement | None = None  # the whole tree's, set by its first pass's first job
    place: Placement | None = None  # this pass's nodes'
    context: int = 0  # the cache's length before the tree: its first node's position
    audit: bool = False
    would_drop: tuple[int, ...] = ()
    probe_seconds: float = 0.0

    @property
    def finishing(self) -> bool:
        """Whether this pass takes the tree to its end: its verdict can be made."""
        return self.end == len(self.tree)

    def rows_of(self, nodes: list[int]) -> torch.Tensor:
        """x's rows of `nodes`."""
        return torch.tensor(nodes) - self.start


class Verifier:
    """One pass per step of the batch: the trees of every seated request, once each has
    sent its next one, go through the layers together. Layers are applied to the live
    nodes as they arrive (those already queued in one job) and a layer's slot released as
    soon as it is applied, so each layer is read once for the whole batch. At the exit
    layer the pruner may drop nodes of each tree; they and their descendants skip the
    remaining layers. A request's target cache (which may start from a reused prefix)
    keeps its accepted path; a request joins and leaves between passes. A request's first
    tree (its prompt) beside requests already decoding goes in chunks, one a pass, as
    `chunks` sizes them."""

    def __init__(
        self,
        target: FlashTarget,
        exit_layer: int | None,
        unit: ComputeUnit,
        jitter: Jitter,
        audit_every: int = 0,
        probe_when: ProbeWhen = always,
        project_chains: bool = False,
        chunks: PrefillChunks | None = None,
    ) -> None:
        self.target = target
        self.chunks = chunks or PrefillChunks(verify=None)
        self.carried: dict[int, _Tree] = {}  # by seat: the prompts part-way through
        # the last pass's start, its decoding requests' rows and its prompts' rows
        self.last_pass: tuple[float, int, int] | None = None
        # project each tree's predicted chain at the pass's end, all trees' in one read of
        # the LM head (not where the head streams: the projector reads it once a step)
        self.project_chains = project_chains
        self.exit_layer = exit_layer  # None: no probes, the pruner is out of the loop
        self.probe_when = probe_when  # tree nodes -> whether this pass probes at exit_layer
        self.unit = unit
        self.jitter = jitter
        self.audit_every = audit_every  # every n-th step the pruner's drops still run in full
        self.passes = 0  # the next pass's index: the prefetcher's, on each layer
        self.queued: list[_Layer] = []  # a run's layers that came before this job wanted them

    async def run(
        self,
        inbox: VerifierInbox,
        outbox: VerifierOutbox,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        passes: Passes[Occupant, DraftTree, DraftRound] = Passes()
        try:
            with inbox.arrivals, inbox.layers, inbox.prune_verdicts:
                with outbox.releases, outbox.probes:
                    task_status.started()
                    await self._serve(passes, inbox, outbox)
        finally:
            # those whose leaving we never read (a request whose crew failed hears of it
            # from the batch before its ends close)
            for occupant in passes.seated.values():
                occupant.close()

    async def _serve(
        self,
        passes: Passes[Occupant, DraftTree, DraftRound],
        inbox: VerifierInbox,
        outbox: VerifierOutbox,
    ) -> None:
        async for message in inbox.arrivals:
            await self._arrived(message, passes)
            del message  # no request's cache outlives its request here (its KV is large)
            if rounds := passes.rounds_ready():
                await self._draft(rounds)
            while trees := passes.pass_ready():  # a prompt part-way through may go on alone
                await self._pass(trees, passes, inbox, outbox)

    async def _arrived(
        self, message: Arrival, passes: Passes[Occupant, DraftTree, DraftRound]
    ) -> None:
        match message:
            case TakeSeat():
                passes.seat(message.seat, Occupant.taken(message))
            case LeaveSeat():
                self.carried.pop(message.seat, None)
                await self._let_go(passes.unseat(message.seat))
                message.done.set()
            case StepAside():
                passes.step_aside(message.seat)
            case DraftRound():
                if not passes.add_round(message.seat, message):  # its request has gone:
                    message.round.error = RuntimeError("the request left the batch")
                    message.done.set()  # nothing waits for it
            case DraftTree():
                occupant = passes.seated.get(message.seat)
                if occupant is not None:  # else its request is gone
                    await occupant.take_commit()
                    passes.add_tree(message.seat, message)

    async def _pass(
        self,
        trees: list[tuple[int, Occupant, DraftTree]],
        passes: Passes[Occupant, DraftTree, DraftRound],
        inbox: VerifierInbox,
        outbox: VerifierOutbox,
    ) -> None:
        """One pass over the trees sent, and the prompts part-way through; the requests
        found gone leave their seats, and the prompts not through yet wait for the next."""
        await self.jitter()
        batch = [
            self.carried.pop(s) if s in self.carried else _Tree(s, o, tree, _token_tree(tree))
            for s, o, tree in trees
        ]
        self._share_rows(batch)
        gone = await self._verify([t for t in batch if t.end > t.start], inbox, outbox)
        for seat in gone:
            occupant = passes.unseat(seat)
            assert occupant is not None  # it was in the pass
            occupant.close()
        for t in batch:
            if not t.finishing and t.seat not in gone:
                t.start, t.x, t.place = t.end, None, None
                self.carried[t.seat] = t
                passes.add_tree(t.seat, t.message)

    def _share_rows(self, batch: list[_Tree]) -> None:
        """Each tree's nodes in this pass: the decoding requests' whole, the prompts' within
        the rows the scheduler gives them beside those, in seat order (or, beside requests
        whose step is not known yet, the prompts it takes whole); and the decoding
        requests' step (with and without prompts beside them), learned from each pass up
        to the next."""
        joining = [t for t in batch if t.message.step == 0]
        decoding = sum(len(t.tree) for t in batch if t.message.step > 0)
        started = time.perf_counter()
        if not decoding:  # the next requests to decode will have a step of their own
            self.chunks.forget()
        elif self.last_pass is not None:
            last, last_decoding, last_prompts = self.last_pass
            if not last_prompts:
                self.chunks.observe(started - last)
            elif last_decoding:
                self.chunks.observe_chunk(started - last, last_decoding, last_prompts)
        left = [len(t.tree) - t.start for t in joining]
        rows = self.chunks.rows(decoding, sum(left))
        waiting: set[int] = set()  # prompts that came together: some wait for the next pass
        if rows is None:
            now = self.chunks.together(len(batch) - len(joining), decoding, left)
            waiting = {t.seat for t, whole in zip(joining, now, strict=True) if not whole}
        for t in batch:
            if t.message.step > 0:
                t.end = len(t.tree)
                continue
            t.end = (
                t.start
                if t.seat in waiting
                else chunk_end(t.start, len(t.tree), t.message.n_committed, rows)
            )
            if rows is not None:
                rows = max(0, rows - (t.end - t.start))
        self.last_pass = (started, decoding, sum(t.end - t.start for t in joining))

    async def _let_go(self, occupant: Occupant | None) -> None:
        """A request that left: its last accepted path kept, for the prefix cache."""
        if occupant is None:
            return
        try:
            await occupant.take_commit()
            if occupant.kept is not None:
                await self.unit.run(occupant.cache.keep, occupant.kept)
        finally:
            occupant.close()

    async def _draft(self, asked: list[DraftRound]) -> None:
        """The draft forwards of every request still drafting, in one job. Where it fails,
        each runs again alone, so that only the request whose forward fails raises."""
        try:
            await self.unit.run(run_rounds, [message.round for message in asked])
        except Exception as error:
            if len(asked) == 1:
                asked[0].round.error = error
            else:
                for message in asked:  # a failed job leaves its rounds unrun: they may rerun
                    try:
                        await self.unit.run(run_rounds, [message.round])
                    except Exception as own:
                        message.round.error = own
        for message in asked:
            message.done.set()

    async def _verify(
        self, batch: list[_Tree], inbox: VerifierInbox, outbox: VerifierOutbox
    ) -> list[int]:
        """One pass over `batch`; each tree's final hidden states go to its request.
        Returns the seats whose requests had gone."""
        step, self.passes = self.passes, self.passes + 1
        n_layers = self.target.args.n_layers
        for t in batch:
            t.live = list(range(t.start, t.end))
            t.passes += 1
            t.probes = (
                self.exit_layer is not None
                and t.finishing
                and len(t.tree) > t.message.n_committed
                and self.probe_when(len(t.tree))
            )
        probe_at = self.exit_layer if any(t.probes for t in batch) else None
        layer_a_job = sum(t.end - t.start for t in batch) > LAYER_A_JOB_ROWS
        io_wait = compute = 0.0
        layer = 0
        left: list[int] = []  # the seats whose requests ended during the pass
        while layer < n_layers:
            # up to the exit layer first when this pass probes there: the pruner's verdicts
            # decide which nodes go on
            last = probe_at if probe_at is not None and layer <= probe_at else n_layers - 1
            waited = time.perf_counter()
            arrived = await self._layers_arrived(
                inbox.layers, step, layer, layer if layer_a_job else last
            )
            started = time.perf_counter()
            tensors = [weights.tensors for weights in arrived]
            left += [t.seat for t in batch if _has_left(t.occupant)]
            batch = [t for t in batch if t.seat not in left]
            # the jobs' own time: a wait behind a round drafted ahead on the unit is no cost
            # of the trees' nodes
            if not batch:  # every request left: the layers are only let go
                seconds = 0.0
            elif layer == 0:  # one job, not three: each hands over between threads (units.py)
                firsts, seconds = await self.unit.run_timed(
                    _first_layers, self.target, batch, tensors
                )
                for t, (x, whole, place, context) in zip(batch, firsts, strict=True):
                    t.x, t.whole, t.place, t.context = x, whole, place, context
                    t.occupant.kept = None
            else:
                xs, seconds = await self.unit.run_timed(
                    _apply_layers, batch, tensors, self.target.args, layer
                )
                for t, x in zip(batch, xs, strict=True):
                    t.x = x
            io_wait += started - waited
            compute += seconds
            for weights in arrived:
                if weights.slot is not None:
                    await outbox.releases.send(SlotRelease(step=step, slot=weights.slot))
            layer += len(arrived)
            for t in batch:
                committed = t.message.n_committed
                if t.occupant.progress is not None and committed >= PREFILL_SHOWN:
                    done = t.start + (min(t.end, committed) - t.start) * layer // n_layers
                    t.occupant.progress(done, committed, "prefill")
            if layer - 1 == probe_at:
                for t in batch:
                    if t.probes:
                        await self._prune(t, layer - 1, inbox, outbox)
        rows = sum(t.end - t.start for t in batch)
        finishing = [t for t in batch if t.finishing]
        projected: list[dict[int, torch.Tensor]] = [{} for _ in finishing]
        projecting = 0.0  # the head's, apart from the layers' compute: priced apart
        if self.project_chains and finishing:
            projected, projecting = await self.unit.run_timed(
                _chains_projected, self.target, finishing
            )
        gone = left
        for t, logits in zip(finishing, projected, strict=True):
            final = await self._final(t, (io_wait, compute, projecting), rows, len(batch), logits)
            try:
                await t.occupant.finals.send(final)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                gone.append(t.seat)  # its projector has ended: the request was cancelled
            else:
                t.occupant.awaiting_commit = True
        return gone

    async def _final(
        self,
        t: _Tree,
        seconds: tuple[float, float, float],
        rows: int,
        requests: int,
        logits: dict[int, torch.Tensor],
    ) -> FinalHidden:
        """A tree's last-layer hidden states with the pass's figures: its `seconds` waiting
        for layers, computing them and projecting the chains."""
        io_wait, compute, projecting = seconds
        pruned = t.end - t.start - len(t.live)
        return FinalHidden(
            step=t.message.step,
            tree=t.message,
            position=t.context,
            nodes=tuple(t.live),
            hidden=await self._rows(t, t.live),
            io_wait_seconds=io_wait,
            verify_seconds=compute,
            project_seconds=projecting,
            pruned=pruned,
            saved_node_layers=pruned * (self.target.args.n_layers - 1 - (self.exit_layer or 0)),
            probe_seconds=t.probe_seconds,
            audit=t.audit,
            would_drop=t.would_drop,
            pass_rows=rows,
            parallel=requests,
            logits=logits,
            passes=t.passes,
        )

    async def _rows(self, t: _Tree, nodes: list[int]) -> torch.Tensor:
        """The tree's hidden states of `nodes`: all of x as it is, a subset gathered on the
        unit (units.py)."""
        assert t.x is not None  # set by the pass's first job
        if nodes == list(range(t.start, t.end)):
            return t.x
        return await self.unit.run(t.x.__getitem__, t.rows_of(nodes))

    async def _layers_arrived(
        self, layers: trio.MemoryReceiveChannel[LayerWeights], step: int, first: int, last: int
    ) -> list[_Layer]:
        """Layer `first` of this pass (waiting for it), then those after it up to `last` that
        have already arrived, until one holds a slot: applied in one job, since a job per
        layer cost about 1 ms of thread handoff each (a resident 1-row pass, 28 layers:
        127-135 ms against 100). A job holds at most one slot, so the prefetcher can read
        into the other meanwhile. A run's layers past `last` wait in `queued`."""
        if not self.queued:
            self.queued = _layers(await layers.receive())
        arrived = [self.queued.pop(0)]
        while arrived[-1].layer < last and arrived[-1].slot is None:
            if not self.queued:
                try:
                    self.queued = _layers(layers.receive_nowait())
                except trio.WouldBlock:
                    break
            arrived.append(self.queued.pop(0))
        for expected, weights in enumerate(arrived, start=first):
            if (weights.step, weights.layer) != (step, expected):
                raise RuntimeError(
                    f"verifier expected layer {expected} of pass {step}, got layer "
                    f"{weights.layer} of pass {weights.step}"
                )
        return arrived

    async def _prune(
        self, t: _Tree, layer: int, inbox: VerifierInbox, outbox: VerifierOutbox
    ) -> None:
        """Ask the pruner about a tree's live nodes at the exit layer; on an audit step its
        drops are only noted, else they leave the pass."""
        assert t.x is not None  # the pass's first job has run
        asked = time.perf_counter()
        message = t.message
        hidden = await self._rows(t, t.live)
        await outbox.probes.send(
            ExitProbe(
                step=message.step, tree=message, layer=layer, nodes=tuple(t.live), hidden=hidden
            )
        )
        verdict = await inbox.prune_verdicts.receive()
        # committed tokens are never dropped: their KV entries must reach the cache
        dropped = [n for n in verdict.dropped if n >= message.n_committed]
        alive = t.tree.without(dropped)
        kept = [n for n in t.live if alive[n]]
        t.probe_seconds = time.perf_counter() - asked
        t.audit = bool(self.audit_every) and message.step % self.audit_every == 0
        if t.audit:
            t.would_drop = tuple(n for n in t.live if n not in kept)  # run them anyway
        else:
            t.live = kept


class _Layer(NamedTuple):
    """One layer of the prefetcher's runs (LayerWeights), as a job takes it."""

    step: int
    layer: int
    tensors: LayerTensors
    slot: int | None


def _layers(message: LayerWeights) -> list[_Layer]:
    return [
        _Layer(message.step, layer, tensors, message.slot)
        for layer, tensors in zip(message.layers, message.tensors, strict=True)
    ]


def _token_tree(message: DraftTree) -> TokenTree:
    return TokenTree(message.tokens, message.parents)


def _first_layers(
    target: FlashTarget, batch: list[_Tree], layers: list
) -> list[tuple[torch.Tensor, Placement, Placement, int]]:
    """A pass's first job: for a tree's first pass, its request's last accepted path kept
    in its KV cache and the tree placed after it (the masks on the unit too: a prompt's are
    large); the pass's nodes embedded and the first `layers` applied to all. Returns per
    tree x [end - start, d_model], the whole tree's placement, this pass's nodes' and the
    context length."""
    xs, wholes, blocks, contexts = [], [], [], []
    for t in batch:
        cache, whole, context = t.occupant.cache, t.whole, t.context
        if whole is None:  # its first pass
            if t.occupant.kept is not None:
                cache.keep(t.occupant.kept)
            context = cache.length
            whole = tree_placement(target.rope, context, t.tree, target.dtype)
        # a chunk sees the earlier chunks' KV in the pending block, and none after it
        place = whole if (t.start, t.end) == (0, len(t.tree)) else whole.chunk(t.start, t.end)
        xs.append(target.embed(list(t.tree.tokens[t.start : t.end])))
        wholes.append(whole)
        blocks.append((cache, place))
        contexts.append(context)
    out = batch_layers_forward(xs, layers, target.args, blocks, 0)
    return [
        (x, whole, place, n)
        for x, whole, (_, place), n in zip(out, wholes, blocks, contexts, strict=True)
    ]


def _chains_projected(target: FlashTarget, batch: list[_Tree]) -> list[dict[int, torch.Tensor]]:
    """Each tree's predicted chain from its last committed node, projected to logits in
    one batch for all: node -> [vocab]."""
    chains, rows = [], []
    for t in batch:
        assert t.x is not None  # the pass has run
        live = set(t.live)
        chain = t.tree.predicted_chain(t.message.n_committed - 1, t.message.draft_ranks, live)
        chains.append(chain)
        rows.append(t.x[t.rows_of(chain)])
    logits = target.logits(torch.cat(rows)).split([len(c) for c in chains])
    return [dict(zip(c, lg, strict=True)) for c, lg in zip(chains, logits, strict=True)]


def _apply_layers(batch: list[_Tree], layers: list, args, first: int) -> list[torch.Tensor]:
    """Each tree's x: [n, d_model] placed whole; only its live rows advance through
    `layers`, the target's layers first, first + 1, ..."""
    rows: list[torch.Tensor] = []
    blocks: list[Block] = []
    for t in batch:
        assert t.x is not None and t.place is not None  # set by the pass's first job
        everyone = len(t.live) == t.x.shape[0]
        index = t.rows_of(t.live)
        rows.append(t.x if everyone else t.x[index])
        # the whole tree keeps its placement: cache writes stay slices
        blocks.append((t.occupant.cache, t.place if everyone else t.place.rows(index)))
    out = batch_layers_forward(rows, layers, args, blocks, first)
    xs = []
    for t, advanced in zip(batch, out, strict=True):
        assert t.x is not None
        if len(t.live) == t.x.shape[0]:
            xs.append(advanced)
        else:
            x = t.x.clone()
            x[t.rows_of(t.live)] = advanced
            xs.append(x)
    return xs
