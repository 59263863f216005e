"""The `lever-actors` console entry point: OpenMP's thread policy, set before the CLI loads
torch, because OpenMP reads it only once, when it loads. Values the user set are kept.

- Idle threads sleep rather than spin (OMP_WAIT_POLICY=PASSIVE): spinning threads lose
  their time slices beside a busy process.
- Threads fill only the cores other processes keep out of use (OMP_NUM_THREADS), measured
  at start: beside one busy neighbour on two cores, one thread decoded faster than two
  that take turns with it (`bench/thread_policy.py`, docs/status.md). A core counts as
  taken only when at least 3/4 busy in each of three 0.2 s windows, so that a process that
  has just exited (freeing its memory) does not count: it did, once, when `serve` started
  right after `generate` and ran on one thread.
"""

import os
import time

WINDOWS = 3  # a neighbour counts only if busy in every one: a process that is just
WINDOW_SECONDS = 0.2  # exiting (freeing its memory) is busy in the first window only
TAKEN = 0.75  # of a core's time busy, for the core to count as taken


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


os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if "OMP_NUM_THREADS" not in os.environ:
    free = idle_cores()
    if free is not None and free < (os.cpu_count() or 1):
        os.environ["OMP_NUM_THREADS"] = str(free)

from lever_actors.cli import main  # noqa: E402  (after the thread policy, which torch reads on load)

__all__ = ["main"]
