"""How many threads each compute unit's torch work uses.

OpenMP's default lets idle worker threads spin for a while before they sleep. Beside another
busy process the spinning threads lose their time slices: on two cores with one busy
neighbour, memory-resident decoding fell from 4.4 to 1.6 tok/s, and ran at 2.3 with idle
threads sleeping (OMP_WAIT_POLICY=PASSIVE). OpenMP reads that policy once, when torch
loads, so only a process's entry point can set it: the CLI does (`lever_actors/launch.py`),
a library user sets it in the environment.

Threads per unit: the batched "npu" unit uses torch's intra-op threads (one per core, or
what OMP_NUM_THREADS says); the "cpu" unit, whose work is small (draft batches of a few
nodes, pruning, on-demand projection), one thread. The two units side by side then ask
for at most one thread more than the npu alone.
"""

from __future__ import annotations

import torch


def unit_threads(split: bool) -> dict[str, int]:
    """Intra-op threads per compute unit; with one unit for everything, it gets them all."""
    threads = torch.get_num_threads()
    return {"npu": threads, "cpu": 1 if split else threads}
