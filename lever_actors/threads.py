"""OpenMP's thread policy: the variables a process of ours gets before torch loads, because
OpenMP reads them only once, when it loads. Values the user set are kept.

- Threads fill only the cores other processes keep out of use (OMP_NUM_THREADS), measured
  at start, and idle threads sleep (OMP_WAIT_POLICY=PASSIVE): beside one busy neighbour on
  two cores, spinning threads lost their time slices and decoded at half the speed.
- On an idle machine every core gets a thread. Idle threads sleep too where our own two
  compute units share the cores (the pipeline: a spinning team of one unit takes the
  cores the other needs), and spin as torch's default has them where one stream of
  matrix products runs alone (`generate --model`, and the bench's memory-resident AR and
  peers in their child processes), which spinning made 10-30% faster.
  Figures: `bench/thread_policy.py`, docs/status.md.
- A core counts as taken only when at least 3/4 busy in each of three 0.2 s windows, so
  that a process that has just exited (freeing its memory) does not count.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

WINDOWS = 3  # a neighbour counts only if busy in every one: a process that is just
WINDOW_SECONDS = 0.2  # exiting (freeing its memory) is busy in the first window only
TAKEN = 0.75  # of a core's time busy, for the core to count as taken
# names the variables set only because the command runs our pipeline (comma-separated), so
# that a child process computing one stream alone can go without them
PIPELINE_ONLY = "LEVER_ACTORS_PIPELINE_ONLY"


def idle_cores(windows: int = WINDOWS, seconds: float = WINDOW_SECONDS) -> int | None:
    """Cores the rest of the machine left idle (we idle meanwhile) in the least busy of
    `windows` windows of `seconds`, from /proc/stat; None where it cannot be read."""

    def totals() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    cores = os.cpu_count() or 1
    try:
        samples = [totals()]
        for _ in range(windows):
            time.sleep(seconds)
            samples.append(totals())
    except (OSError, ValueError, IndexError):
        return None
    shares = [
        (busy1 - busy0) / (all1 - all0)
        for (busy0, all0), (busy1, all1) in zip(samples, samples[1:], strict=False)
        if all1 > all0
    ]
    if not shares:
        return None
    busy = cores * min(shares)
    return max(1, cores - int(busy + 1 - TAKEN))


def thread_policy(
    environ: Mapping[str, str], free: int | None, cores: int, argv: list[str]
) -> dict[str, str]:
    """The variables to add to `environ` for the command `argv`, given `free` idle cores of
    `cores` (None: not known); never one the user set. What is set for the pipeline only
    (on an idle machine) is named in PIPELINE_ONLY too."""
    policy = {"OMP_WAIT_POLICY": "PASSIVE"}
    if free is not None and free < cores:
        policy["OMP_NUM_THREADS"] = str(free)
    elif runs_one_stream(argv):
        policy = {}
    added = {k: v for k, v in policy.items() if k not in environ}
    if added and "OMP_NUM_THREADS" not in policy:
        added[PIPELINE_ONLY] = ",".join(added)
    return added


def runs_one_stream(argv: list[str]) -> bool:
    """Whether the command computes one stream of products alone: `generate --model`."""
    return "generate" in argv and any(a.split("=")[0] == "--model" for a in argv)


def one_stream_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a child process that computes one stream of products alone (a
    memory-resident baseline, a peer): without what was set for our pipeline only."""
    dropped = {PIPELINE_ONLY, *environ.get(PIPELINE_ONLY, "").split(",")}
    return {k: v for k, v in environ.items() if k not in dropped}
