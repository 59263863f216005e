"""The pruner alone: exit probes in, one prune verdict per probe out, in order."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import trio

from lever_actors.actors.jitter import Jitter
from lever_actors.actors.pruner import Pruner
from lever_actors.channels.messages import DraftTree, ExitProbe, PruneVerdict
from lever_actors.device.units import ComputeUnit
from lever_actors.policy.pruning import keep_everything

TIMEOUT = 10


def probe(step: int, n: int = 6) -> ExitProbe:
    tree = DraftTree(
        step=step,
        tokens=tuple(range(n)),
        parents=tuple(range(-1, n - 1)),
        n_committed=2,
        draft_probs=(1.0,) * n,
        draft_ranks=(0,) * n,
        shadows=((),) * n,
        draft_seconds=0.0,
        draft_rounds=(),
    )
    return ExitProbe(step=step, tree=tree, layer=1, nodes=tuple(range(n)), hidden=torch.zeros(n, 8))


async def run_pruner(pruner: Pruner, probes: list[ExitProbe]) -> list[PruneVerdict]:
    """Send the probes one by one, read one verdict each, then close the inbox and check
    that the pruner closes its outbox and returns."""
    send, inbox = trio.open_memory_channel[ExitProbe](1)
    outbox, receive = trio.open_memory_channel[PruneVerdict](1)
    verdicts = []
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(pruner.run, inbox, outbox)
            async with send, receive:
                for p in probes:
                    await send.send(p)
                    verdicts.append(await receive.receive())
                    with pytest.raises(trio.WouldBlock):  # exactly one verdict per probe
                        receive.receive_nowait()
                await send.aclose()
                with pytest.raises(trio.EndOfChannel):
                    await receive.receive()
    return verdicts


async def test_keep_everything_answers_every_probe_with_no_drops():
    unit = ComputeUnit("cpu")
    verdicts = await run_pruner(
        Pruner(keep_everything, unit, Jitter(0, 0)), [probe(s) for s in range(4)]
    )
    assert verdicts == [PruneVerdict(step=s, dropped=()) for s in range(4)]
    assert unit.jobs == 4  # the policy ran on the unit, once per probe


async def test_the_policy_decides_and_runs_off_the_event_loop():
    seen: list[tuple[int, tuple[int, ...], bool]] = []
    loop_thread = threading.get_ident()

    def drop_odd_nodes_past_the_step(p: ExitProbe) -> list[int]:
        seen.append((p.step, p.nodes, threading.get_ident() != loop_thread))
        return [n for n in p.nodes if n % 2 and n > p.step]  # a list: sent as a tuple

    pruner = Pruner(drop_odd_nodes_past_the_step, ComputeUnit("cpu"), Jitter(0.001, 7))
    verdicts = await run_pruner(pruner, [probe(0), probe(3, n=8), probe(9, n=3)])
    assert verdicts == [
        PruneVerdict(step=0, dropped=(1, 3, 5)),
        PruneVerdict(step=3, dropped=(5, 7)),
        PruneVerdict(step=9, dropped=()),
    ]
    assert [(s, n) for s, n, _ in seen] == [
        (0, tuple(range(6))),
        (3, tuple(range(8))),
        (9, (0, 1, 2)),
    ]
    assert all(off_loop for _, _, off_loop in seen)


async def test_closing_an_idle_pruner_ends_it():
    assert await run_pruner(Pruner(keep_everything, ComputeUnit("cpu"), Jitter(0, 0)), []) == []


async def test_an_error_in_the_policy_propagates_from_run():
    class PolicyBroke(Exception):
        pass

    def broken(p: ExitProbe) -> tuple[int, ...]:
        raise PolicyBroke(f"cannot score step {p.step}")

    send, inbox = trio.open_memory_channel[ExitProbe](1)
    outbox, receive = trio.open_memory_channel[PruneVerdict](1)
    with trio.fail_after(TIMEOUT):
        with pytest.RaisesGroup(pytest.RaisesExc(PolicyBroke, match="cannot score step 5")):
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    Pruner(broken, ComputeUnit("cpu"), Jitter(0, 0)).run, inbox, outbox
                )
                async with send, receive:
                    await send.send(probe(5))
                    with contextlib.suppress(trio.EndOfChannel):
                        await receive.receive()
