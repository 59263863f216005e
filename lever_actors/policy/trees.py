"""Growing a draft tree: the mechanics (TreeBuilder) and the shape policies.

Static shapes (chain of k, per-depth widths) are what conventional speculative decoding
uses. The gain-cost policy grows best-first: it adds the candidate most likely to be
accepted, batch by batch, while expected tokens per second of predicted step time rise.
"""

from __future__ import annotations

import bisect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import torch

from lever_actors.channels.messages import ALONE, Beside
from lever_actors.config import MAX_STATIC_WIDTH
from lever_actors.model.choosing import Chooser
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.matcher import Matcher, masked
from lever_actors.model.placement import Placement, chain_placement
from lever_actors.model.transformer import Transformer
from lever_actors.model.tree import TokenTree
from lever_actors.policy.calibration import AcceptanceCalibrator
from lever_actors.policy.cost_model import CostModel
from lever_actors.policy.lookup import LOOKUP_RANK, MATCH, ContextIndex

SHADOWS = 4  # untaken candidates kept per expanded node, standing for the mass outside the tree
CANDIDATES = 8  # children considered per expanded node by the gain-cost policy
ROUND_WIDTH = 4  # nodes a draft forward runs for about the price of one
# A round ahead is worth its cost to the pass beside it only while its best node is this
# likely to be accepted (or, a candidate, to be the target's next token): a prose step ran
# 8 rounds ahead at a median of 0.03, a code step 6 at 0.18, and only code gained by them
AHEAD_WORTH = 0.15
# a run node's best children kept, enough for any policy (a whole vocabulary's probabilities
# per node held 39 MB for a 64-node tree of the real draft)
KEPT = max(CANDIDATES, MAX_STATIC_WIDTH) + SHADOWS


@dataclass(frozen=True)
class Children:
    """A run node's most probable next tokens under the draft, best first."""

    probs: list[float]
    tokens: list[int]

    def best(self, k: int) -> list[tuple[float, int]]:
        """The k most probable (probability, token), best first."""
        return list(zip(self.probs[:k], self.tokens[:k], strict=True))


RunBatch = Callable[[list[int]], Awaitable[None]]  # runs TreeBuilder.run on some unit


class TreeBuilder:
    """One tree under construction: the committed chain, then draft nodes. A node is "run"
    when the draft model has processed it (at the next free slot of the pending block),
    which gives the distribution of its children: the draft's own, or when sampling, that
    of its perturbed scores, whose top token is the one the shared noise makes it draw.
    Under a grammar (`matcher`, at the end of the chain) only the tokens it allows after a
    node's path are its children."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        chain: list[int],
        chooser: Chooser,
        unviewed: int = 0,
        matcher: Matcher | None = None,
    ) -> None:
        """`unviewed`: the chain's first nodes the draft never runs, before its view of the
        text begins (engine/state.py): no node sees them, and positions count from after them."""
        self.model = model
        self.cache = cache
        self.chooser = chooser
        self.matcher = matcher
        self.n_chain = len(chain)
        self.unviewed = unviewed
        self.tokens = list(chain)
        self.parents = list(range(-1, len(chain) - 1))
        self.probs = [1.0] * len(chain)
        self.ranks = [0] * len(chain)  # a node's place among its parent's draft candidates
        self.offsets: dict[int, int] = {}  # node -> slot in the draft cache's pending block
        self.children: dict[int, Children] = {}  # run node -> its best children
        self.rounds: list[int] = []  # nodes in each draft forward so far, the chain's first

    def add(self, parent: int, token: int, prob: float, rank: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.probs.append(prob)
        self.ranks.append(rank)
        return len(self.tokens) - 1

    def child_tokens(self, node: int) -> set[int]:
        return {self.tokens[c] for c, parent in enumerate(self.parents) if parent == node}

    def rebase(self, accepted: Sequence[int], root: int, cap: int) -> TreeBuilder:
        """The next step's builder when the target's next token is `root`, a node drafted
        below the accepted path's end: `root` becomes its committed chain, with the first
        `cap` nodes of the subtree drafted below it. The draft cache commits the accepted
        path and moves the subtree's entries to the front of its pending block."""
        subtree = [root]
        inside = {root}
        for node in range(root + 1, len(self.tokens)):  # a parent precedes its children
            if len(subtree) > cap:
                break
            if self.parents[node] in inside:
                subtree.append(node)
                inside.add(node)
        ran = [n for n in subtree if n in self.offsets]
        self.cache.keep([self.offsets[n] for n in accepted], [self.offsets[n] for n in ran])
        renamed = {old: new for new, old in enumerate(subtree)}
        builder = TreeBuilder(
            self.model, self.cache, [self.tokens[root]], self.chooser, matcher=self.matcher
        )
        for node in subtree[1:]:
            parent = renamed[self.parents[node]]
            builder.add(parent, self.tokens[node], self.probs[node], self.ranks[node])
        builder.offsets = {renamed[n]: slot for slot, n in enumerate(ran)}
        builder.children = {renamed[n]: c for n, c in self.children.items() if n in inside}
        return builder

    def run(self, nodes: list[int], pause: Callable[[], None] | None = None) -> None:
        """Blocking: run the draft model on `nodes` (ancestors already run) in one batch;
        each gets its children's distribution. `pause`: as `Transformer.forward`'s; where it
        raises (units.Abandoned), `nodes` stay unrun and their slots free, the error raised."""
        tokens, place = self.placed(nodes)
        try:
            hidden = self.model.forward(tokens, self.cache, place, pause)
        except BaseException:
            self.unplaced(nodes)
            raise
        self.ran(nodes, hidden, place)

    def placed(self, nodes: list[int]) -> tuple[torch.Tensor, Placement]:
        """`nodes` given the next slots of the cache's pending block: their tokens [n] and
        placement, for a draft forward."""
        tree = TokenTree(tuple(self.tokens), tuple(self.parents))
        for node in nodes:
            self.offsets[node] = len(self.offsets)
        columns = sorted(self.offsets, key=self.offsets.__getitem__)  # node at each slot
        index = torch.tensor(nodes)
        context = self.cache.length
        visible = tree.ancestry()[index][:, columns]  # [len(nodes), span]
        positions = tree.positions(context - self.unviewed)[index]
        cos, sin = self.model.rope.tables(positions, self.model.dtype)
        mask = torch.cat((torch.ones(len(nodes), context, dtype=torch.bool), visible), dim=1)
        offsets = torch.tensor([self.offsets[n] for n in nodes])
        place = Placement(positions, cos, sin, mask, offsets, len(columns))
        return torch.tensor([self.tokens[n] for n in nodes]), place

    def unplaced(self, nodes: list[int]) -> None:
        """A forward of `nodes` failed: they stay unrun, their slots free."""
        for node in nodes:  # the last slots given: what they hold is written over later
            del self.offsets[node]

    def ran(self, nodes: list[int], hidden: torch.Tensor, place: Placement) -> None:
        """The draft forward of `nodes` gave their final hidden states [n, d_model]."""
        self.rounds.append(len(nodes))
        self._rank_children(nodes, hidden, place.positions)

    def run_chain(self, unseen: list[int]) -> None:
        """Blocking: a step's first draft forward, before any draft node: `unseen` (committed
        tokens the draft never ran, the accepted path's deepest nodes) and then the chain,
        in one batch, since two rows cost about a third more than one, not twice. `unseen`
        is committed to the cache; the chain's last node gets its children."""
        tokens, place = self.chain_placed(unseen)
        self.chain_ran(unseen, self.model.forward(tokens, self.cache, place))

    def chain_placed(self, unseen: list[int]) -> tuple[torch.Tensor, Placement]:
        """The step's first forward: `unseen`, then the chain, after the committed context."""
        tokens = torch.tensor([*unseen, *self.tokens[self.unviewed : self.n_chain]])
        place = chain_placement(self.model.rope, self.cache.length, len(tokens), self.model.dtype)
        return tokens, place

    def chain_ran(self, unseen: list[int], hidden: torch.Tensor) -> None:
        """The step's first forward gave its final hidden states."""
        chain = list(range(self.unviewed, self.n_chain))
        self.rounds.append(len(unseen) + len(chain))
        self.cache.commit(len(unseen))  # the chain's entries now open the pending block
        self.offsets = {node: slot for slot, node in enumerate(chain)}
        if chain:  # else a round that only catches the draft up with the text
            last = torch.tensor([self.cache.length + len(chain) - 1])  # its position
            self._rank_children(chain[-1:], hidden[-1:], last)

    def _rank_children(
        self, nodes: list[int], hidden: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Keep the best children of run `nodes`, from their final hidden [n, d_model] at
        `positions` [n]."""
        logits = self.model.logits(hidden)
        if self.matcher is not None:
            allowed = [self.matcher.allowed_after(self._path_tokens(n)) for n in nodes]
            logits = masked(logits, torch.stack(allowed))
        scores = self.chooser.draft_scores(logits, positions + 1)
        probs = torch.softmax(scores.float(), dim=-1).nan_to_num()  # none allowed: all 0
        top = torch.topk(probs, min(KEPT, probs.shape[-1]))
        ranked = zip(top.values.tolist(), top.indices.tolist(), strict=True)
        for node, (values, tokens) in zip(nodes, ranked, strict=True):
            kept = sum(v > 0 for v in values)  # no token a grammar refuses is a child
            self.children[node] = Children(values[:kept], tokens[:kept])

    def _path_tokens(self, node: int) -> list[int]:
        """The tokens from the chain's end down to `node`."""
        tokens = []
        while node >= self.n_chain:
            tokens.append(self.tokens[node])
            node = self.parents[node]
        return tokens[::-1]

    def shadows(self) -> tuple[tuple[int, ...], ...]:
        """Per node: its best candidates that did not become children (empty if not run)."""
        taken_below: dict[int, set[int]] = {}  # node -> its children's tokens
        for node, parent in enumerate(self.parents):
            taken_below.setdefault(parent, set()).add(self.tokens[node])
        out: list[tuple[int, ...]] = []
        for node in range(len(self.tokens)):
            best = self.children.get(node)
            if best is None:
                out.append(())
                continue
            taken = taken_below.get(node, set())
            top = [token for _, token in best.best(SHADOWS + len(taken))]
            out.append(tuple(t for t in top if t not in taken)[:SHADOWS])
        return tuple(out)


@dataclass
class Round:
    """One draft forward of a tree under construction: a round of its `nodes`, or (None)
    the step's first, of the `unseen` committed tokens and the chain."""

    builder: TreeBuilder
    nodes: list[int] | None
    unseen: list[int] = field(default_factory=list)
    error: BaseException | None = None  # where the forward failed

    def placed(self) -> tuple[torch.Tensor, Placement]:
        b = self.builder
        return b.chain_placed(self.unseen) if self.nodes is None else b.placed(self.nodes)

    def ran(self, hidden: torch.Tensor, place: Placement) -> None:
        if self.nodes is None:
            self.builder.chain_ran(self.unseen, hidden)
        else:
            self.builder.ran(self.nodes, hidden, place)

    def unplaced(self) -> None:
        if self.nodes is not None:
            self.builder.unplaced(self.nodes)


def run_rounds(rounds: list[Round]) -> None:
    """Blocking: the draft forwards of several trees (of one draft model, each with its own
    cache) as one: each layer's weights read once for all their rows."""
    model = rounds[0].builder.model
    assert all(r.builder.model is model for r in rounds)  # one engine's draft
    placed: list[tuple[torch.Tensor, Placement]] = []
    try:
        for r in rounds:
            placed.append(r.placed())
        blocks = [(r.builder.cache, place) for r, (_, place) in zip(rounds, placed, strict=True)]
        hidden = model.forward_blocks([tokens for tokens, _ in placed], blocks)
    except BaseException:
        for r in rounds[: len(placed)]:  # those given slots
            r.unplaced()
        raise
    for r, h, (_, place) in zip(rounds, hidden, placed, strict=True):
        r.ran(h, place)


async def grow_static(
    builder: TreeBuilder, widths: tuple[int, ...], cap: int, run: RunBatch
) -> None:
    """Every node at depth d gets its top widths[d] children; a chain is widths (1,)*k."""
    level = [len(builder.tokens) - 1]
    budget = cap
    for depth, width in enumerate(widths):
        children = []
        for node in level:
            best = builder.children[node].best(min(width, budget))
            for rank, (prob, token) in enumerate(best):
                children.append(builder.add(node, token, prob, rank))
            budget -= len(best)
        if budget <= 0 or not children:
            return
        if depth + 1 < len(widths):
            await run(children)
        level = children


class GainCostGrowth:
    """Best-first growth of one tree: every node's estimated probability that the target
    accepts the path to it, and the candidates (top children of run nodes) not yet taken.

    `grow` builds the tree the verifier gets: each round takes the best candidates while
    the objective (expected new tokens / predicted step time) improves, then runs them in
    one batch so their children become candidates; it stops when neither another candidate
    nor another round pays for itself, or at `cap` draft nodes. `grow_ahead` goes on below
    the sent tree while the target verifies it, where draft rounds cost no step time.

    With the committed text (`context`), every node not yet run also offers the token that
    followed its path's end in the text (policy/lookup.py), valued at the rate such copies
    were accepted. A copy needs no draft forward, so a round may take any number of them
    and a run of copies goes as deep as it pays; copies stay leaves of the draft (never run).

    A builder handed over by `TreeBuilder.rebase` already holds nodes drafted ahead; they
    keep their place and are valued like nodes grown here, and its best leaves not yet run
    open the first round."""

    def __init__(
        self,
        builder: TreeBuilder,
        cost: CostModel,
        calibrator: AcceptanceCalibrator,
        context: ContextIndex | None = None,
        beside: Beside = ALONE,
    ) -> None:
        self.builder = builder
        self.cost = cost
        self.beside = beside  # the other requests in the pass
        self.calibrator = calibrator
        self.context = context
        self.root = builder.n_chain - 1
        self.path_prob = {self.root: 1.0}
        for node in range(builder.n_chain, len(builder.tokens)):
            parent, rank = builder.parents[node], builder.ranks[node]
            if rank == LOOKUP_RANK:
                acceptance = calibrator.copy_acceptance()
            else:
                acceptance = self._acceptances(parent, rank + 1)[rank]
            self.path_prob[node] = self.path_prob[parent] * acceptance
        # (path prob, parent, token, draft prob, rank)
        self.candidates: list[tuple[float, int, int, float, int]] = []
        for node in sorted(builder.children):
            self._offer(node)
        for node in range(builder.n_chain, len(builder.tokens)):
            if node not in builder.children:
                self._offer_copy(node)
        self.sent = len(builder.tokens)  # nodes beyond this were drafted ahead, not sent

    def _acceptances(self, node: int, count: int = CANDIDATES) -> list[float]:
        """Estimated acceptance of a run node's `count` best children, given the node was."""
        return self.calibrator.ranked(self.builder.children[node].probs[:count])

    def _offer(self, node: int) -> None:
        taken = self.builder.child_tokens(node)
        best = self.builder.children[node].best(CANDIDATES)
        for rank, ((prob, token), acceptance) in enumerate(
            zip(best, self._acceptances(node), strict=True)
        ):
            if token not in taken:
                gain = self.path_prob[node] * acceptance
                self.candidates.append((gain, node, token, prob, rank))

    def _offer_copy(self, node: int) -> None:
        """Below a node not run: the token that followed its path's end in the text, in its
        place among the candidates."""
        token = None if self.context is None else self.context.follower(self._path_end(node))
        if token is not None and token not in self.builder.child_tokens(node):
            gain = self.path_prob[node] * self.calibrator.copy_acceptance()
            bisect.insort(self.candidates, (gain, node, token, 0.0, LOOKUP_RANK), key=_best_first)

    def _path_end(self, node: int) -> list[int]:
        """The tree's last MATCH tokens (fewer near the chain) on the path down to `node`:
        all a lookup reads of it."""
        path: list[int] = []
        while node > self.root and len(path) < MATCH:
            path.append(self.builder.tokens[node])
            node = self.builder.parents[node]
        return path[::-1]

    def _take(self, candidate: tuple[float, int, int, float, int]) -> int:
        gain, parent, token, prob, rank = candidate
        # its twin goes too: a copy offered below a node before it ran, and the draft's own
        # offer once it did, may hold one token
        self.candidates = [c for c in self.candidates if (c[1], c[2]) != (parent, token)]
        node = self.builder.add(parent, token, prob, rank)
        self.path_prob[node] = gain
        self._offer_copy(node)
        return node

    def _objective(self, nodes: int, expected: float, rounds: list[int]) -> float:
        tokens = 1 + expected  # the bonus token always comes
        chain = self.root + 1
        return self.cost.pass_rate(chain + nodes, rounds, tokens, self.beside, chain)

    async def grow(self, cap: int, run: RunBatch) -> None:
        builder = self.builder
        draft_nodes = range(builder.n_chain, len(builder.tokens))
        nodes, expected = len(draft_nodes), sum(self.path_prob[n] for n in draft_nodes)
        best = self._objective(nodes, expected, builder.rounds)
        confident = self.calibrator.acceptance(0.99, 0)
        first_choice = self.calibrator.first_choice_rate()
        final = False  # the last round: fill with whatever still pays, no deeper look follows
        # the first round's draft nodes: a carried tree's best leaves, where its likeliest path
        # ends (the sent tree's last round and a round ahead abandoned midway run none)
        drafted = self._runnable_leaves(len(builder.tokens))[:ROUND_WIDTH]
        while True:
            self.candidates.sort(key=_best_first)
            while self.candidates and nodes < cap:
                gain, rank = self.candidates[0][0], self.candidates[0][4]
                # Before the last round, once the round is as wide as costs no more than one
                # node, leave a candidate for later if a child of a node this round adds
                # could beat it: depth first where the draft is confident. A copy costs no
                # forward, so it never waits.
                wide = len(drafted) >= ROUND_WIDTH and rank != LOOKUP_RANK
                if wide and not final and gain < self.path_prob[drafted[0]] * confident:
                    break
                score = self._objective(nodes + 1, expected + gain, builder.rounds)
                if score <= best:
                    break
                node = self._take(self.candidates[0])
                if rank != LOOKUP_RANK:
                    drafted.append(node)
                nodes, expected, best = nodes + 1, expected + gain, score
            if final or nodes >= cap:
                break
            # Another round costs a draft forward; it can only pay if a child of the best
            # new node would be worth adding at the rate first choices have been taken.
            hope = max((self.path_prob[n] for n in drafted), default=0.0) * first_choice
            rounds = [*builder.rounds, len(drafted)]
            if not drafted or self._objective(nodes + 1, expected + hope, rounds) <= best:
                final = True
                continue
            await run(drafted)
            for node in drafted:
                self._offer(node)
            best = self._objective(nodes, expected, builder.rounds)  # the round is paid for
            drafted = []  # the next round's
        self.sent = len(builder.tokens)

    def _runnable_leaves(self, end: int) -> list[int]:
        """The draft nodes before `end` that the draft may run next, likeliest first: not
        run, their parent run, and no copy (copies stay leaves)."""
        builder = self.builder
        leaves = [
            n
            for n in range(builder.n_chain, end)
            if n not in builder.children
            and builder.ranks[n] != LOOKUP_RANK
            and builder.parents[n] in builder.children
        ]
        return sorted(leaves, key=self.path_prob.__getitem__, reverse=True)

    async def grow_ahead(self, width: int, cap: int, run: RunBatch) -> bool:
        """One round below the sent tree, for the next step: run the `width` most valuable of
        the sent leaves (their children become candidates) and the candidates (each the
        target's likely next token if the path to its parent is accepted, so its subtree
        may become the next tree). False when there is nothing left worth a round."""
        builder = self.builder
        if len(builder.tokens) - self.sent >= cap:
            return False
        leaves = [(self.path_prob[n], n) for n in self._runnable_leaves(self.sent)]
        offers = [(c[0], c) for c in self.candidates if c[4] != LOOKUP_RANK]  # copies: not run
        room = cap - (len(builder.tokens) - self.sent)
        # by value: a leaf to run, or a candidate to take
        ranked: list[tuple[float, int | tuple[float, int, int, float, int]]] = [*leaves, *offers]
        best = sorted(ranked, key=lambda item: item[0], reverse=True)[:width]
        if not best or best[0][0] < AHEAD_WORTH:
            return False
        chosen: list[int] = []
        for _, item in best:
            if isinstance(item, int):
                chosen.append(item)
            elif room > 0:
                chosen.append(self._take(item))
                room -= 1
        if not chosen:
            return False
        await run(chosen)
        for node in chosen:
            self._offer(node)
        return True


def _best_first(candidate: tuple[float, int, int, float, int]) -> tuple[float, float, int]:
    """Sort key: best gain first; ties go to the likelier, then the higher-ranked token."""
    gain, _, _, prob, rank = candidate
    return -gain, -prob, rank


async def grow_gain_cost(
    builder: TreeBuilder,
    cost: CostModel,
    calibrator: AcceptanceCalibrator,
    cap: int,
    run: RunBatch,
    context: ContextIndex | None = None,
    beside: Beside = ALONE,
) -> GainCostGrowth:
    """Lever's tree: best-first under the gain-cost objective (see GainCostGrowth)."""
    growth = GainCostGrowth(builder, cost, calibrator, context, beside)
    await growth.grow(cap, run)
    return growth
