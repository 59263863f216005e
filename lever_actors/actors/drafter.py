"""The drafter actor: the draft model, in DRAM, proposes a token tree each step."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import trio

from lever_actors.actors.jitter import Jitter
from lever_actors.channels.messages import Beside, Commit, DraftRequest, DraftTree, Then
from lever_actors.config import TreeSpec
from lever_actors.device.units import Abandoned, ComputeUnit
from lever_actors.model.choosing import Chooser
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.matcher import Matcher
from lever_actors.model.sampling import GREEDY, Sampling
from lever_actors.model.transformer import Transformer
from lever_actors.policy.calibration import AcceptanceCalibrator
from lever_actors.policy.copies import copied_chain
from lever_actors.policy.cost_model import CostModel
from lever_actors.policy.lookup import LOOKUP_RANK, ContextIndex
from lever_actors.policy.schedule import UNPRICED_CHUNK_ROWS, rows_within
from lever_actors.policy.trees import (
    GainCostGrowth,
    Round,
    TreeBuilder,
    grow_gain_cost,
    grow_static,
)

# A drafter alone (no `rounds`: its tests, a tool) runs forwards of at most this many nodes
# on the "cpu" unit, wider ones on the batched "npu" unit (on a machine without an
# accelerator both are CPU worker threads); in the engine the verifier runs them all.
SMALL_BATCH = 4
# Nodes per draft-ahead round: no dearer than one, and small enough for the "cpu" unit, which
# leaves the "npu" unit to the verifier.
AHEAD_WIDTH = SMALL_BATCH


# runs one draft forward with other requests' (engine/wiring.py: through the verifier)
RunRound = Callable[[Round], Awaitable[None]]


@dataclass
class DrafterInbox:
    requests: trio.MemoryReceiveChannel[DraftRequest]
    commits: trio.MemoryReceiveChannel[Commit]


@dataclass
class DraftPolicy:
    spec: TreeSpec
    cost: CostModel | None = None  # needed by the gain-cost tree
    calibrator: AcceptanceCalibrator | None = None  # needed by the gain-cost tree
    ahead: bool = False  # gain-cost only: draft the next tree while flash paces this one's pass
    lookup: bool = False  # gain-cost: nodes not yet run also offer copies of the text
    sampling: Sampling = GREEDY  # the request's: the draft draws with the target's noise
    # the fewest requests in a pass from which a step of trees copies the text instead
    # (the plan's `copies_from`), the draft kept
    copies_from: int | None = None


class Drafter:
    """Keeps its own KV cache of the committed text from the token `view` on (the request's,
    which may start from a reused prefix of the prompt). Each step it first runs the
    committed tokens it has not seen, then grows the tree below the last one by its policy.

    A gain-cost tree's nodes it ran are kept until the commit: when the target's next token
    is one of them, below the accepted path's end, the subtree below it is the next tree
    already (its children known, no forward needed to start it), and only what still pays
    is added to it. With `ahead`, it also keeps growing the tree after sending it, until the
    commit comes, so that more of the target's next tokens are found run.

    A request alone whose prompt the draft would run for longer than a one-token step sends
    it to the target first, its first token not waiting for the draft, which runs it with
    the next tree.
    Beside other requests, a long text the draft has not seen (a joining prompt) is not
    run in one forward, which would hold up theirs: the step sends the chain alone (one
    token) and, until its commit comes, the draft catches up a chunk a round, each beside
    the others' rounds."""

    def __init__(
        self,
        model: Transformer | None,
        policy: DraftPolicy,
        prompt: list[int],
        cache: KVCache | None,
        units: tuple[ComputeUnit, ComputeUnit],
        jitter: Jitter,
        *,
        cached: int = 0,
        view: int = 0,
        matcher: Matcher | None = None,
        seat: int = 0,
        rounds: RunRound | None = None,
    ) -> None:
        """`cache`: the draft's (None without a draft model), which holds the KV of the
        prompt's tokens from `view` on, if any; `cached`: the prompt's first tokens whose KV
        the target's cache already holds; `matcher`: the request's grammar (a copy of the
        projector's), which the drafter moves along the committed text; `seat`: the
        request's in the verifier's batch, on each tree; `rounds`: runs a draft forward
        with the batch's other requests' (else it runs on our units alone)."""
        self.model = model
        self.seat = seat
        self.rounds = rounds
        self.policy = policy
        self.cpu, self.npu = units
        self.jitter = jitter
        self.cache = cache
        seen = view + (cache.length if cache is not None else 0)  # the text's tokens we hold
        # committed, seen by the target but not by us
        self.backlog: list[int] = prompt[seen:cached]
        self.chain: list[int] = prompt[cached:]  # committed tokens the target has not seen yet
        self.unviewed = max(0, view - cached)  # the chain's first ones, before our view
        self.builder: TreeBuilder | None = None  # the last tree's
        self.growth: GainCostGrowth | None = None  # the last tree's, when gain-cost
        self.carried: TreeBuilder | None = None  # the next tree, when the commit hit a run node
        self.chooser = Chooser(policy.sampling, noise_dtype=np.float32)  # ranks only
        self.drafting = policy.spec  # how the draft proposes, where a trial of copies ends
        self.step_spec = policy.spec  # how the last tree was proposed
        # the committed text, where copies are proposed or may be from a later step on
        self.context = ContextIndex(prompt) if self._copies_possible else None
        self.matcher = matcher
        self.catch_up = 0  # rows a round while the draft catches up with the text (0: it has)
        self.fresh = True  # no step drafted yet: the prompt may go first (_prompt_first)

    async def run(
        self,
        inbox: DrafterInbox,
        outbox: trio.MemorySendChannel[DraftTree],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with inbox.requests, inbox.commits, outbox:
            task_status.started()
            async for request in inbox.requests:
                await self.jitter()
                tree = await self.draft(request)
                await outbox.send(tree)
                if self.catch_up:
                    commit = await self._commit_catching_up(inbox.commits)
                else:
                    commit = await self._commit_drafting_ahead(inbox.commits, request.max_nodes)
                if commit is None:  # no more steps
                    return
                await self.commit(commit, tree, request.max_nodes)

    async def _commit_drafting_ahead(
        self, commits: trio.MemoryReceiveChannel[Commit], cap: int
    ) -> Commit | None:
        """The step's commit (None once they end); until it comes, draft ahead if we may:
        only beside a pass that flash paces, which leaves the cores idle. Beside a
        compute-bound pass the rounds slowed verification more than their hits saved
        (memory-resident, verification took 1.8x as long). The commit ends the round in
        flight at its next layer: the next tree waits for no more of it."""
        growth, cost = self.growth, self.policy.cost
        if not self.policy.ahead or growth is None:
            return await _next(commits)
        assert cost is not None  # a gain-cost tree's growth: it has its cost model
        if not cost.io_bound(growth.sent):
            return await _next(commits)
        committed = threading.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._draft_ahead, growth, cap, committed)
            try:
                return await _next(commits)
            finally:
                committed.set()

    async def _commit_catching_up(
        self, commits: trio.MemoryReceiveChannel[Commit]
    ) -> Commit | None:
        """The step's commit (None once they end); until it comes, the text the draft has
        not seen, `catch_up` tokens a round, until what is left goes with the next chain."""
        assert self.model is not None and self.cache is not None  # only a draft catches up
        rows, got = self.catch_up, []
        async with trio.open_nursery() as nursery:

            async def take() -> None:
                got.append(await _next(commits))

            nursery.start_soon(take)
            while not got and len(self.backlog) >= rows:
                chunk, self.backlog = self.backlog[:rows], self.backlog[rows:]
                builder = TreeBuilder(self.model, self.cache, [], self.chooser)
                await self._forward(builder, None, chunk)
        self.catch_up = 0
        return got[0]

    @property
    def _unseen(self) -> int:
        """Committed tokens in our view that the draft has not run."""
        return len(self.backlog) + len(self.chain) - self.unviewed

    def _prompt_first(self, beside: Beside) -> bool:
        """Whether the first step that would draft sends the text alone (a request's prompt),
        the draft running it with the next tree: where that run costs more than a one-token
        step, the first token comes that much sooner, for one more pass (the first tree's
        tokens come a step later). A 318-token prompt's run took the draft 1.5 s beside a
        65 ms step (the real pair, resident, 2-core EPYC). Alone only: beside requests
        decoding, the draft catches up in chunks instead (_catch_up_rows); for requests that
        came together, which request's first token came early varied from run to run
        either way (4 at once under 3 GiB), so they draft as they did."""
        cost = self.policy.cost
        if cost is None or self.model is None or beside.requests:
            return False  # unpriced trees, or requests beside, draft as they always did
        return cost.draft(self._unseen) > cost.step_seconds(1, [], 1.0)

    def _catch_up_rows(self, beside: Beside) -> int:
        """Tokens a round while the draft catches up with the text beside other requests:
        about one pass of theirs; 0 where what it has not seen fits one (or none of them
        decodes yet)."""
        unseen = self._unseen
        if beside.rows == 0:  # alone, or beside requests that came with it: none decodes yet
            return 0
        cost = self.policy.cost
        if cost is None:
            rows = UNPRICED_CHUNK_ROWS
        else:
            rows = rows_within(cost.pass_compute_seconds(beside.rows), cost.draft, unseen)
        return rows if unseen > rows else 0

    async def _draft_ahead(self, growth: GainCostGrowth, cap: int, until: threading.Event) -> None:
        """Rounds below the sent tree until there is nothing worth a round or `until` is set;
        a round abandoned midway leaves its nodes unrun (TreeBuilder.run)."""

        async def run(nodes: list[int]) -> None:
            # it gives way, between its layers, to the jobs of the pass it runs beside: a
            # verifier's layer waits for a layer of the draft, not for the round
            assert self.builder is not None  # the sent tree's
            await self.cpu.run_yielding(self.builder.run, nodes, until=until)

        with contextlib.suppress(Abandoned):
            while not until.is_set() and await growth.grow_ahead(AHEAD_WIDTH, cap, run):
                pass

    async def _run(self, nodes: list[int]) -> None:
        assert self.builder is not None  # the tree being drafted
        await self._forward(self.builder, nodes)

    async def _forward(
        self, builder: TreeBuilder, nodes: list[int] | None, unseen: list[int] | None = None
    ) -> None:
        """A draft forward: a round of `nodes`, or (None) the step's first, of `unseen`
        committed tokens and the chain; with the batch's others where `rounds` runs them."""
        if self.rounds is not None:
            await self.rounds(Round(builder, nodes, unseen or []))
        elif nodes is None:
            await self.npu.run(builder.run_chain, unseen or [])
        else:
            unit = self.cpu if len(nodes) <= SMALL_BATCH else self.npu
            await unit.run(builder.run, nodes)

    async def draft(self, request: DraftRequest) -> DraftTree:
        started = time.perf_counter()
        spec = self.step_spec = self._spec_beside(request.beside)
        if spec.kind == "none":  # autoregressive: the tree is the committed chain
            return self._chain_tree(request, [], started)
        if spec.kind == "lookup":  # the chain, then copies of the text below it
            cost, calibrator, context = self.policy.cost, self.policy.calibrator, self.context
            assert cost is not None and calibrator is not None and context is not None
            copies = copied_chain(
                context, len(self.chain), cost, calibrator, request.max_nodes, request.beside
            )
            self.builder = self.growth = self.carried = None  # the draft's next tree starts anew
            return self._chain_tree(request, copies, started)
        builder = self.carried
        self.carried = None
        fresh, self.fresh = self.fresh, False
        if builder is None and (
            (rows := self._catch_up_rows(request.beside))
            or (fresh and self._prompt_first(request.beside))
        ):
            # one token this step; the draft catches up while the target takes the chain
            # (beside others, a chunk a round), or runs it with its next tree
            self.backlog += self.chain[self.unviewed :]
            self.unviewed = 0
            self.builder = self.growth = None
            self.catch_up = rows
            return self._chain_tree(request, [], started)
        if builder is None:
            assert self.model is not None and self.cache is not None
            builder = TreeBuilder(
                self.model,
                self.cache,
                self.chain,
                self.chooser,
                unviewed=self.unviewed,
                matcher=self.matcher,
            )
            await self._forward(builder, None, self.backlog)
            self.backlog, self.unviewed = [], 0
        carried = len(builder.tokens) - builder.n_chain
        self.builder = builder
        if spec.kind == "gaincost":
            cost, calibrator = self.policy.cost, self.policy.calibrator
            assert cost is not None and calibrator is not None  # a gain-cost tree needs them
            self.growth = await grow_gain_cost(
                builder,
                cost,
                calibrator,
                request.max_nodes,
                self._run,
                self.context if self.policy.lookup else None,
                request.beside,
            )
        else:
            await grow_static(builder, spec.widths, request.max_nodes, self._run)
        return DraftTree(
            step=request.step,
            tokens=tuple(builder.tokens),
            parents=tuple(builder.parents),
            n_committed=builder.n_chain,
            draft_probs=tuple(builder.probs),
            draft_ranks=tuple(builder.ranks),
            shadows=builder.shadows(),
            draft_seconds=time.perf_counter() - started,
            draft_rounds=tuple(builder.rounds),
            drafted_ahead=carried,
            seat=self.seat,
        )

    def _spec_beside(self, beside: Beside) -> TreeSpec:
        """How this step proposes: the draft's trees copy the text instead in a pass of at
        least `copies_from` requests, where the plan priced copies faster."""
        spec, most = self.policy.spec, self.policy.copies_from
        if spec is self.drafting and most is not None and beside.requests + 1 >= most:
            return TreeSpec("lookup", cap=spec.cap)
        return spec

    def _chain_tree(self, request: DraftRequest, copies: list[int], started: float) -> DraftTree:
        """The committed chain the target has not seen, then `copies` of the text below it:
        one path, no draft forward."""
        tokens, n = (*self.chain, *copies), len(self.chain)
        return DraftTree(
            step=request.step,
            tokens=tokens,
            parents=tuple(range(-1, len(tokens) - 1)),
            n_committed=n,
            draft_probs=(1.0,) * n + (0.0,) * len(copies),
            draft_ranks=(0,) * n + (LOOKUP_RANK,) * len(copies),
            shadows=((),) * len(tokens),
            draft_seconds=time.perf_counter() - started,
            draft_rounds=(),
            seat=self.seat,
        )

    @property
    def _copies_possible(self) -> bool:
        return self.policy.lookup or self.policy.spec.kind in ("lookup", "gaincost")

    async def commit(self, commit: Commit, tree: DraftTree, max_nodes: int) -> None:
        self.chain = list(commit.next_tokens)
        path = [tree.tokens[n] for n in commit.accepted if n >= tree.n_committed]
        committed = [*path, *commit.next_tokens]
        if self.context is not None:
            self.context.extend(committed)
        if self.matcher is not None:
            for token in committed:
                self.matcher.consume(token)
        if self.policy.calibrator is not None:
            self.policy.calibrator.observe(
                tree.parents, tree.draft_probs, tree.draft_ranks, tree.n_committed, commit.accepted
            )
        await self._keep_in_draft(commit, tree, max_nodes)
        self._then(commit.then)

    async def _keep_in_draft(self, commit: Commit, tree: DraftTree, max_nodes: int) -> None:
        """The draft's KV keeps the accepted nodes it ran; those it did not run wait in the
        backlog (all of them, after a step of copies), for its next forward."""
        if self.model is None or self.cache is None:  # no draft model: nothing to keep
            return
        if self.step_spec.kind == "lookup":  # a step of copies: the draft saw none
            self.backlog += [tree.tokens[n] for n in commit.accepted]
            return
        builder, gain_cost = self.builder, self.growth is not None
        self.builder = self.growth = None
        if builder is None:  # autoregressive: nothing drafted, nothing to keep
            return
        accepted = commit.accepted[builder.unviewed :]  # those in our view
        # a tree carried over is a tree drafted: not where copies come next
        carry = gain_cost and commit.then in ("same", "trees")
        root = self._next_token_drafted(commit, builder) if carry else None
        if root is not None:
            # on the unit: the cache's copies there start no second OpenMP team (units.py)
            self.carried = await self.npu.run(builder.rebase, accepted, root, max_nodes)
            return
        # Nodes we ran form a prefix of the accepted path: keep those in the cache; the
        # accepted nodes we never ran (the deepest ones) are committed but still unseen.
        ran = [n for n in accepted if n in builder.offsets]
        await self.npu.run(self.cache.keep, [builder.offsets[n] for n in ran])
        self.backlog = [tree.tokens[n] for n in accepted[len(ran) :]]

    def _then(self, then: Then) -> None:
        """Propose as the commit says from the next step on: copies of the text, with the
        draft kept (a trial) or let go of with its KV; or the draft's trees again."""
        if then == "same":
            return
        if then == "trees":
            self.policy.spec = self.drafting
            return
        self.policy.spec = TreeSpec("lookup", cap=self.drafting.cap)
        if then == "copies":
            self.model = self.cache = None
            self.builder = self.growth = self.carried = None
            self.backlog = []

    def _next_token_drafted(self, commit: Commit, builder: TreeBuilder) -> int | None:
        """The node we ran below the accepted path's end for the target's next token."""
        if len(commit.next_tokens) != 1:
            return None
        end, token = commit.accepted[-1], commit.next_tokens[0]
        for node, parent in enumerate(builder.parents):
            if parent == end and builder.tokens[node] == token and node in builder.offsets:
                return node
        return None


async def _next(commits: trio.MemoryReceiveChannel[Commit]) -> Commit | None:
    try:
        return await commits.receive()
    except trio.EndOfChannel:
        return None
