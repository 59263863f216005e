"""The `lever-actors` console entry point: OpenMP's thread policy, set before the CLI loads
torch, because OpenMP reads it only once, when it loads. Values the user set are kept.

- Idle threads sleep rather than spin (OMP_WAIT_POLICY=PASSIVE): spinning threads lose
  their time slices beside a busy process.
- Threads fill only the cores other processes keep out of use (OMP_NUM_THREADS), measured
  over half a second at start: beside one busy neighbour on two cores, one thread decoded
  faster than two that take turns with it (`bench/thread_policy.py`, docs/status.md). A
  core counts as taken only when at least 3/4 busy, so that a process that has just
  exited (freeing its memory) does not count.
"""

import os
import time

SAMPLE_SECONDS = 0.5
TAKEN = 0.75  # of a core's time busy, for the core to count as taken


def idle_cores(seconds: float = SAMPLE_SECONDS) -> int | None:
    """Cores the rest of the machine left idle over `seconds` (we idle meanwhile), from
    /proc/stat; None where it cannot be read."""

    def totals() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    try:
        busy0, all0 = totals()
        time.sleep(seconds)
        busy1, all1 = totals()
    except (OSError, ValueError, IndexError):
        return None
    cores = os.cpu_count() or 1
    if all1 <= all0:
        return None
    busy = cores * (busy1 - busy0) / (all1 - all0)
    return max(1, cores - int(busy + 1 - TAKEN))


os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if "OMP_NUM_THREADS" not in os.environ:
    free = idle_cores()
    if free is not None and free < (os.cpu_count() or 1):
        os.environ["OMP_NUM_THREADS"] = str(free)

from lever_actors.cli import main  # noqa: E402  (after the thread policy, which torch reads on load)

__all__ = ["main"]
