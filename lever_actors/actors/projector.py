"""The projector actor: final norm + LM head along the accepted path only."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import trio

from lever_actors.actors.jitter import Jitter
from lever_actors.channels.messages import FinalHidden, StepStats, Verdict
from lever_actors.device.units import ComputeUnit
from lever_actors.model.choosing import Chooser, RowLogprobs
from lever_actors.model.matcher import Matcher, masked
from lever_actors.model.sampling import GREEDY, Sampling
from lever_actors.model.tree import TokenTree
from lever_actors.policy.lookup import LOOKUP_RANK


class Projector:
    """Walks from the last committed node: project it, choose the target's token (the argmax,
        or the seeded sample), and if a live child holds that token move to it and repeat;
        otherwise the chosen token is the bonus token. Under a grammar (`matcher`) the
        choice at each node takes the mask of the grammar's state after the path to it,
        and the matcher takes each emitted token, as sequential decoding's would.

        On demand, a node is projected together with its predicted descendants (each time the
        live child the drafter ranked first) in one batch, since one pass over the LM head
        costs about the same for a few rows as for one. LM-head work thus follows the accepted
        path plus at most the mispredicted rest of one predicted chain, whatever the tree's
        size. Eager projection instead projects every live node in one batch first: what a head
    streamed from flash needs, read once per step."""

    def __init__(
        self,
        project: Callable[[torch.Tensor], torch.Tensor],
        unit: ComputeUnit,
        jitter: Jitter,
        eager: bool = False,
        sampling: Sampling = GREEDY,
        top: int = 0,
        matcher: Matcher | None = None,
    ) -> None:
        self.project = project  # final norm + LM head: hidden [n, d_model] -> logits [n, vocab]
        self.unit = unit  # the "cpu" unit on demand, the batched "npu" unit when eager
        self.jitter = jitter
        self.eager = eager  # project every live node the walk may reach in one batch, then walk
        self.chooser = Chooser(sampling)  # the request's: which token a node's logits choose
        self.top = top  # the request's top_logprobs: alternatives reported per token
        self.matcher = matcher  # the request's grammar, at its committed text

    async def run(
        self,
        inbox: trio.MemoryReceiveChannel[FinalHidden],
        outbox: trio.MemorySendChannel[Verdict],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with inbox, outbox:
            task_status.started()
            async for final in inbox:
                await self.jitter()
                await outbox.send(await self.unit.run(self.walk, final))

    def walk(self, final: FinalHidden) -> Verdict:
        started = time.perf_counter()
        message = final.tree
        tree = TokenTree(message.tokens, message.parents)
        row = {node: i for i, node in enumerate(final.nodes)}
        # node -> its logits [vocab]: the predicted chain's came with the pass, projected
        # with the batch's other trees' (one read of the LM head for all)
        logits: dict[int, torch.Tensor] = dict(final.logits)
        if self.eager:  # the walk starts at the last committed node: none before it matter
            walkable = [n for n in final.nodes if n >= message.n_committed - 1]
            self._project(final, walkable, row, logits)
        positions = tree.positions(final.position) + 1  # of the tokens each node chooses
        node = message.n_committed - 1
        path = [node]  # the nodes whose chosen tokens are emitted
        tokens: list[int] = []
        from_draft: list[bool] = []
        while True:
            if node not in logits:
                chain = tree.predicted_chain(node, message.draft_ranks, row)
                self._project(final, chain, row, logits)
            token = self._choose(logits[node], int(positions[node]))
            child = next(
                (c for c in tree.children(node) if c in row and tree.tokens[c] == token), None
            )
            tokens.append(token)
            from_draft.append(child is not None)
            if child is None:
                break
            path.append(child)
            node = child
        accepted = [*range(message.n_committed - 1), *path]
        stats = StepStats(
            step=message.step,
            tree_nodes=len(tree),
            live_nodes=len(final.nodes),
            pruned=final.pruned,
            saved_node_layers=final.saved_node_layers,
            probe_seconds=final.probe_seconds,
            audited=final.audit,
            false_prunes=len(set(final.would_drop) & set(accepted)),
            projected_nodes=len(logits),
            drafted_ahead=message.drafted_ahead,
            copied=message.draft_ranks.count(LOOKUP_RANK),
            draft_rounds=message.draft_rounds,
            draft_seconds=message.draft_seconds,
            io_wait_seconds=final.io_wait_seconds,
            verify_seconds=final.verify_seconds,
            project_seconds=final.project_seconds + time.perf_counter() - started,
            pass_rows=final.pass_rows,
            parallel=final.parallel,
            passes=final.passes,
        )
        emitted = RowLogprobs(torch.stack([logits[n] for n in path]))
        return Verdict(
            step=message.step,
            accepted=tuple(accepted),
            tokens=tuple(tokens),
            from_draft=tuple(from_draft),
            logprobs=tuple(emitted.of(tokens)),
            stats=stats,
            top_logprobs=tuple(emitted.top(self.top)) if self.top else (),
        )

    def _project(
        self,
        final: FinalHidden,
        nodes: list[int],
        row: dict[int, int],
        logits: dict[int, torch.Tensor],
    ) -> None:
        """Project `nodes` in one batch; record each one's logits."""
        rows = self.project(final.hidden[[row[n] for n in nodes]])
        logits.update(zip(nodes, rows, strict=True))

    def _choose(self, logits: torch.Tensor, position: int) -> int:
        """The target's token at `position` from a node's logits [vocab]: under the grammar,
        which then takes it, when there is one."""
        if self.matcher is not None:
            logits = masked(logits, self.matcher.allowed())
        [token] = self.chooser.choose(logits[None], torch.tensor([position]))
        if self.matcher is not None:
            self.matcher.consume(token)
        return token
