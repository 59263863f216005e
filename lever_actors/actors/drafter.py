"""The drafter actor: the draft model, in DRAM, proposes a token tree each step."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import trio

from lever_actors.actors.jitter import Jitter
from lever_actors.channels.messages import Commit, DraftRequest, DraftTree
from lever_actors.config import TreeSpec
from lever_actors.device.units import ComputeUnit
from lever_actors.model.placement import Placement
from lever_actors.model.transformer import Transformer
from lever_actors.model.tree import TokenTree


@dataclass
class DrafterInbox:
    requests: trio.MemoryReceiveChannel[DraftRequest]
    commits: trio.MemoryReceiveChannel[Commit]


class Drafter:
    """Keeps its own KV cache of the committed text. Each step it first runs the committed
    tokens it has not seen, then grows the tree below the last one by its TreeSpec."""

    def __init__(
        self,
        model: Transformer | None,
        spec: TreeSpec,
        prompt: list[int],
        capacity: int,
        unit: ComputeUnit,
        jitter: Jitter,
    ) -> None:
        self.model = model
        self.spec = spec
        self.unit = unit
        self.jitter = jitter
        self.capacity = capacity
        self.backlog: list[int] = []  # committed, in neither cache of ours nor the tree's chain
        self.chain: list[int] = list(prompt)  # committed tokens the target has not seen yet

    async def run(
        self,
        inbox: DrafterInbox,
        outbox: trio.MemorySendChannel[DraftTree],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with inbox.requests, inbox.commits, outbox:
            if self.model is not None:
                self.cache = self.model.new_cache(self.capacity)
            task_status.started()
            async for request in inbox.requests:
                await self.jitter()
                tree, self.offsets = await self.unit.run(self.draft, request)
                await outbox.send(tree)
                try:
                    commit = await inbox.commits.receive()
                except trio.EndOfChannel:
                    return
                self.commit(commit, tree)

    def draft(self, request: DraftRequest) -> tuple[DraftTree, dict[int, int]]:
        """Blocking. -> the tree, and the pending-cache offset of every node we ran."""
        started = time.perf_counter()
        if self.spec.kind == "none":  # autoregressive: the tree is the committed chain alone
            chain = TokenTree.chain(self.chain)
            tree = DraftTree(
                step=request.step,
                tokens=chain.tokens,
                parents=chain.parents,
                n_committed=len(chain),
                draft_probs=(1.0,) * len(chain),
                draft_seconds=0.0,
            )
            return tree, {}
        if self.backlog:
            self.model.forward(torch.tensor(self.backlog), self.cache)
            self.cache.commit(len(self.backlog))
            self.backlog = []
        grower = _TreeGrower(self.model, self.cache, self.chain)
        grower.grow(self.spec, request.max_nodes)
        tree = DraftTree(
            step=request.step,
            tokens=tuple(grower.tokens),
            parents=tuple(grower.parents),
            n_committed=len(self.chain),
            draft_probs=tuple(grower.probs),
            draft_seconds=time.perf_counter() - started,
        )
        return tree, grower.offsets

    def commit(self, commit: Commit, tree: DraftTree) -> None:
        self.chain = list(commit.next_tokens)
        if self.model is None:
            return
        # Nodes we ran form a prefix of the accepted path: keep those in the cache; the
        # accepted nodes we never ran (the deepest ones) are committed but still unseen.
        ran = [n for n in commit.accepted if n in self.offsets]
        self.cache.keep([self.offsets[n] for n in ran])
        self.backlog = [tree.tokens[n] for n in commit.accepted[len(ran) :]]


class _TreeGrower:
    """Builds one tree: the committed chain, then draft nodes, running the draft model on
    each node whose children are wanted (at the next free slot of the pending block)."""

    def __init__(self, model: Transformer, cache, chain: list[int]) -> None:
        self.model = model
        self.cache = cache
        self.tokens = list(chain)
        self.parents = list(range(-1, len(chain) - 1))
        self.probs = [1.0] * len(chain)
        self.offsets: dict[int, int] = {}
        self.child_probs: dict[int, torch.Tensor] = {}  # node -> draft distribution of its child
        self._run(list(range(len(chain))), wanted=1)

    def grow(self, spec: TreeSpec, max_nodes: int) -> None:
        level = [len(self.tokens) - 1]
        budget = max_nodes
        for depth, width in enumerate(spec.widths):
            children = []
            for node in level:
                top = torch.topk(self.child_probs[node], min(width, budget))
                for prob, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                    children.append(self._add(node, token, prob))
                budget -= len(top.values)
            if depth + 1 < len(spec.widths) and budget > 0 and children:
                self._run(children, wanted=len(children))
            level = children
            if budget <= 0:
                return

    def _add(self, parent: int, token: int, prob: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.probs.append(prob)
        return len(self.tokens) - 1

    def _run(self, nodes: list[int], wanted: int) -> None:
        """Run the draft model on `nodes` (whose ancestors have all run) in one batch; the
        last `wanted` of them get the distribution of their children."""
        tree = TokenTree(tuple(self.tokens), tuple(self.parents))
        for node in nodes:
            self.offsets[node] = len(self.offsets)
        span = len(self.offsets)
        ancestry = tree.ancestry()
        columns = sorted(self.offsets, key=self.offsets.get)  # node at each pending offset
        index = torch.tensor(nodes)
        visible = ancestry[index][:, columns]  # [len(nodes), span]
        context = self.cache.length
        cos, sin = self.model.rope.tables(tree.positions(context)[index], self.model.dtype)
        mask = torch.cat((torch.ones(len(nodes), context, dtype=torch.bool), visible), dim=1)
        offsets = torch.tensor([self.offsets[n] for n in nodes])
        place = Placement(cos, sin, mask, offsets, span)
        hidden = self.model.forward(
            torch.tensor([self.tokens[n] for n in nodes]), self.cache, place
        )
        probs = torch.softmax(self.model.logits(hidden[-wanted:]).float(), dim=-1)
        for row, node in enumerate(nodes[-wanted:]):
            self.child_probs[node] = probs[row]
