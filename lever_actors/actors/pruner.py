"""The pruner actor: scores tree nodes at the exit layer and tells the verifier what to drop."""

from __future__ import annotations

import trio

from lever_actors.actors.jitter import Jitter
from lever_actors.channels.messages import ExitProbe, PruneVerdict
from lever_actors.device.units import ComputeUnit
from lever_actors.policy.pruning import PrunePolicy


class Pruner:
    def __init__(self, policy: PrunePolicy, unit: ComputeUnit, jitter: Jitter) -> None:
        self.policy = policy
        self.unit = unit
        self.jitter = jitter

    async def run(
        self,
        inbox: trio.MemoryReceiveChannel[ExitProbe],
        outbox: trio.MemorySendChannel[PruneVerdict],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with inbox, outbox:
            task_status.started()
            async for probe in inbox:
                await self.jitter()
                dropped = await self.unit.run(self.policy, probe)
                await outbox.send(PruneVerdict(step=probe.step, dropped=tuple(dropped)))
