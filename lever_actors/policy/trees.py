"""Growing a draft tree: the mechanics (TreeBuilder) and the shape policies.

Static shapes (chain of k, per-depth widths) are what conventional speculative decoding
uses. The gain-cost policy grows best-first: it adds the candidate most likely to be
accepted, batch by batch, while expected tokens per second of predicted step time rise.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import torch

from lever_actors.model.kv_cache import KVCache
from lever_actors.model.placement import Placement
from lever_actors.model.transformer import Transformer
from lever_actors.model.tree import TokenTree
from lever_actors.policy.calibration import AcceptanceCalibrator
from lever_actors.policy.cost_model import CostModel

SHADOWS = 4  # untaken candidates kept per expanded node, standing for the mass outside the tree
CANDIDATES = 8  # children considered per expanded node by the gain-cost policy

RunBatch = Callable[[list[int]], Awaitable[None]]  # runs TreeBuilder.run on some unit


class TreeBuilder:
    """One tree under construction: the committed chain, then draft nodes. A node is "run"
    when the draft model has processed it (at the next free slot of the pending block),
    which gives the distribution of its children."""

    def __init__(self, model: Transformer, cache: KVCache, chain: list[int]) -> None:
        self.model = model
        self.cache = cache
        self.tokens = list(chain)
        self.parents = list(range(-1, len(chain) - 1))
        self.probs = [1.0] * len(chain)
        self.ranks = [0] * len(chain)  # a node's place among its parent's draft candidates
        self.offsets: dict[int, int] = {}  # node -> slot in the draft cache's pending block
        self.child_probs: dict[int, torch.Tensor] = {}  # node -> draft distribution [vocab]
        self.rounds: list[int] = []  # nodes in each draft forward so far, the chain's first

    def add(self, parent: int, token: int, prob: float, rank: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.probs.append(prob)
        self.ranks.append(rank)
        return len(self.tokens) - 1

    def run(self, nodes: list[int], wanted: int | None = None) -> None:
        """Blocking: run the draft model on `nodes` (ancestors already run) in one batch;
        the last `wanted` of them (default all) get their children's distribution."""
        wanted = len(nodes) if wanted is None else wanted
        self.rounds.append(len(nodes))
        tree = TokenTree(tuple(self.tokens), tuple(self.parents))
        for node in nodes:
            self.offsets[node] = len(self.offsets)
        columns = sorted(self.offsets, key=self.offsets.__getitem__)  # node at each slot
        index = torch.tensor(nodes)
        context = self.cache.length
        visible = tree.ancestry()[index][:, columns]  # [len(nodes), span]
        cos, sin = self.model.rope.tables(tree.positions(context)[index], self.model.dtype)
        mask = torch.cat((torch.ones(len(nodes), context, dtype=torch.bool), visible), dim=1)
        offsets = torch.tensor([self.offsets[n] for n in nodes])
        place = Placement(cos, sin, mask, offsets, len(columns))
        tokens = torch.tensor([self.tokens[n] for n in nodes])
        hidden = self.model.forward(tokens, self.cache, place)
        probs = torch.softmax(self.model.logits(hidden[len(nodes) - wanted :]).float(), dim=-1)
        for row, node in enumerate(nodes[len(nodes) - wanted :]):
            self.child_probs[node] = probs[row]

    def shadows(self) -> tuple[tuple[int, ...], ...]:
        """Per node: its best candidates that did not become children (empty if not run)."""
        children: dict[int, set[int]] = {}
        for node, parent in enumerate(self.parents):
            children.setdefault(parent, set()).add(self.tokens[node])
        out = []
        for node in range(len(self.tokens)):
            probs = self.child_probs.get(node)
            if probs is None:
                out.append(())
                continue
            wanted = min(SHADOWS + len(children.get(node, ())), probs.numel())
            top = torch.topk(probs, wanted).indices.tolist()
            taken = children.get(node, set())
            out.append(tuple(t for t in top if t not in taken)[:SHADOWS])
        return tuple(out)


async def grow_static(
    builder: TreeBuilder, widths: tuple[int, ...], cap: int, run: RunBatch
) -> None:
    """Every node at depth d gets its top widths[d] children; a chain is widths (1,)*k."""
    level = [len(builder.tokens) - 1]
    budget = cap
    for depth, width in enumerate(widths):
        children = []
        for node in level:
            probs = builder.child_probs[node]
            top = torch.topk(probs, min(width, budget, probs.numel()))
            ranked = enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True))
            for rank, (prob, token) in ranked:
                children.append(builder.add(node, token, prob, rank))
            budget -= len(top.values)
        if budget <= 0 or not children:
            return
        if depth + 1 < len(widths):
            await run(children)
        level = children


async def grow_gain_cost(
    builder: TreeBuilder,
    cost: CostModel,
    calibrator: AcceptanceCalibrator,
    cap: int,
    run: RunBatch,
) -> None:
    """Best-first: candidates are the top children of run nodes, ranked by the estimated
    probability that the target accepts the whole path to them. Each round takes the best
    candidates while the objective (expected new tokens / predicted step time) improves,
    then runs them in one batch so their children become candidates. Stops when neither
    another candidate nor another round pays for itself, or at `cap` draft nodes."""
    committed = len(builder.tokens)
    path_prob = {committed - 1: 1.0}  # node -> estimated probability its path is accepted
    # (path prob, parent, token, draft prob, rank)
    candidates: list[tuple[float, int, int, float, int]] = []

    def offer(node: int) -> None:
        probs = builder.child_probs[node]
        top = torch.topk(probs, min(CANDIDATES, probs.numel()))
        ranked = enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True))
        for rank, (prob, token) in ranked:
            gain = path_prob[node] * calibrator.acceptance(prob, rank)
            candidates.append((gain, node, token, prob, rank))

    def objective(nodes: int, expected: float, rounds: list[int]) -> float:
        tokens = 1 + expected  # the bonus token always comes
        return tokens / cost.step_seconds(committed + nodes, rounds, tokens)

    offer(committed - 1)
    nodes, expected = 0, 0.0
    best = objective(0, 0.0, builder.rounds)
    confident = calibrator.acceptance(0.99, 0)
    final = False  # the last round: fill with whatever still pays, no deeper look follows
    while True:
        # best gain first; ties go to the likelier, then the higher-ranked draft token
        candidates.sort(key=lambda c: (c[0], c[3], -c[4]), reverse=True)
        added: list[int] = []
        while candidates and nodes < cap:
            gain, parent, token, prob, rank = candidates[0]
            # Before the last round, leave a candidate for later if a child of a node this
            # round adds could beat it: depth first where the draft is confident.
            if added and not final and gain < path_prob[added[0]] * confident:
                break
            score = objective(nodes + 1, expected + gain, builder.rounds)
            if score <= best:
                break
            candidates.pop(0)
            node = builder.add(parent, token, prob, rank)
            path_prob[node] = gain
            nodes, expected, best = nodes + 1, expected + gain, score
            added.append(node)
        if final or nodes >= cap:
            return
        # Another round costs a draft forward; it can only pay if a child of the best new
        # node would be worth adding at the acceptance of a confident draft.
        hope = max((path_prob[n] for n in added), default=0.0) * confident
        rounds = [*builder.rounds, len(added)]
        if not added or objective(nodes + 1, expected + hope, rounds) <= best:
            final = True
            continue
        await run(added)
        for node in added:
            offer(node)
