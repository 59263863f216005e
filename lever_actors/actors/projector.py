"""The projector actor: final norm + LM head along the accepted path only."""

from __future__ import annotations

import time

import torch
import trio

from lever_actors.actors.jitter import Jitter
from lever_actors.channels.messages import FinalHidden, Verdict
from lever_actors.device.units import ComputeUnit
from lever_actors.model.layers import output_logits
from lever_actors.model.tree import TokenTree


class Projector:
    """Walks from the last committed node: project it, take the argmax, and if a live child
    holds that token move to it and repeat; otherwise the argmax is the bonus token. The
    LM head thus runs once per accepted token plus one, whatever the size of the tree."""

    def __init__(
        self,
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        eps: float,
        unit: ComputeUnit,
        jitter: Jitter,
        eager: bool = False,
    ) -> None:
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.eps = eps
        self.unit = unit  # the "cpu" unit on demand, the batched "npu" unit when eager
        self.jitter = jitter
        self.eager = eager  # project every live node in one batch, then walk

    async def run(
        self,
        inbox: trio.MemoryReceiveChannel[FinalHidden],
        outbox: trio.MemorySendChannel[Verdict],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with inbox, outbox:
            task_status.started()
            async for final in inbox:
                await self.jitter()
                await outbox.send(await self.unit.run(self.walk, final))

    def walk(self, final: FinalHidden) -> Verdict:
        started = time.perf_counter()
        message = final.tree
        tree = TokenTree(message.tokens, message.parents)
        row = {node: i for i, node in enumerate(final.nodes)}
        eager_logits = self._project(final.hidden) if self.eager else None
        node = message.n_committed - 1
        accepted = list(range(message.n_committed))
        tokens: list[int] = []
        from_draft: list[bool] = []
        while True:
            if eager_logits is not None:
                token = int(eager_logits[row[node]].argmax())
            else:
                token = int(self._project(final.hidden[row[node] : row[node] + 1]).argmax())
            child = next(
                (c for c in tree.children(node) if c in row and tree.tokens[c] == token), None
            )
            tokens.append(token)
            from_draft.append(child is not None)
            if child is None:
                break
            accepted.append(child)
            node = child
        return Verdict(
            step=message.step,
            accepted=tuple(accepted),
            tokens=tuple(tokens),
            from_draft=tuple(from_draft),
            projected_nodes=len(final.nodes) if self.eager else len(tokens),
            project_seconds=time.perf_counter() - started,
            io_wait_seconds=final.io_wait_seconds,
            verify_seconds=final.verify_seconds,
            draft_seconds=message.draft_seconds,
            draft_rounds=message.draft_rounds,
            tree_nodes=len(tree),
            live_nodes=len(final.nodes),
            pruned=final.pruned,
            saved_node_layers=final.saved_node_layers,
            audited=final.audit,
            false_prunes=len(set(final.would_drop) & set(accepted)),
        )

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, d_model] -> logits [n, vocab]"""
        return output_logits(hidden, self.final_norm, self.lm_head, self.eps)
