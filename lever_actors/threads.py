"""OpenMP's thread policy: the variables a process of ours gets before torch loads, because
OpenMP reads them only once, when it loads. Values the user set are kept.

- Threads fill only the cores other processes keep out of use (OMP_NUM_THREADS), measured
  at start, and idle threads sleep (OMP_WAIT_POLICY=PASSIVE): beside one busy neighbour on
  two cores, spinning threads lost their time slices and decoded at half the speed.
- On an idle machine every core gets a thread. Idle threads spin as torch's default has
  them wherever one OpenMP team computes alone: `generate --model`, the engine (its
  default `--units single` runs every job on one thread, device/units.py), and the
  bench's memory-resident AR and peers; spinning made those 10-40% faster. They sleep
  where two compute units share the cores (`--units split`, and a bench, whose children
  with one team go without it): a spinning team of one unit takes the cores the other
  needs, and libgomp sleeps every team after each product anyway once two exist.
  Figures: `benchmarks/thread_policy.py`, docs/benchmarks.md.
- A core counts as taken only when at least 3/4 busy in each of three 0.1 s windows, so
  that a process that has just exited (freeing its memory) does not count. The probe runs
  beside the imports that start no OpenMP team (launch.py), its own process's time left
  out, and not at all for a request for help or the version. For `generate` it runs on
  while the request reads its tokenizer and weights: the policy is set when OpenMP is
  about to load (`settle_policy`: the plain kernels' library, or torch's engine).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import outcome

T = TypeVar("T")

WINDOWS = 3  # a neighbour counts only if busy in every one: a process that is just
WINDOW_SECONDS = 0.1  # exiting (freeing its memory) is busy in the first window only
TAKEN = 0.75  # of a core's time busy, for the core to count as taken
_pending: list[Callable[[], None]] = []  # the policy launch.py left to set (settle_policy)
_pending_lock = threading.Lock()
# names the variables set only because the command may run two compute units
# (comma-separated), so that a child process computing with one team can go without them
PIPELINE_ONLY = "LEVER_ACTORS_PIPELINE_ONLY"


def idle_cores(windows: int = WINDOWS, seconds: float = WINDOW_SECONDS) -> int | None:
    """Cores the rest of the machine left idle in the least busy of `windows` windows of
    `seconds`, from /proc/stat less this process's own time (it may import meanwhile);
    None where it cannot be read."""
    tick = os.sysconf("SC_CLK_TCK")  # /proc/stat's unit

    def totals() -> tuple[int, int, int]:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        ours = os.times()
        return sum(fields) - idle, sum(fields), round((ours.user + ours.system) * tick)

    try:
        samples = [totals()]
        for _ in range(windows):
            time.sleep(seconds)
            samples.append(totals())
    except (OSError, ValueError, IndexError):
        return None
    return cores_left(samples, os.cpu_count() or 1)


def cores_left(samples: list[tuple[int, int, int]], cores: int) -> int | None:
    """The idle cores `samples` show: each (busy, all, ours) in clock ticks, busy counting
    every process, ours this one; None when no window had any time."""
    shares = [
        max(0, (busy1 - busy0) - (ours1 - ours0)) / (all1 - all0)
        for (busy0, all0, ours0), (busy1, all1, ours1) in zip(samples, samples[1:], strict=False)
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
    `cores` (None: not known); never one the user set. What is set for two compute units
    only (on an idle machine) is named in PIPELINE_ONLY too."""
    policy = {"OMP_WAIT_POLICY": "PASSIVE"}
    if free is not None and free < cores:
        policy["OMP_NUM_THREADS"] = str(free)
    elif not runs_two_units(argv):
        policy = {}
    added = {k: v for k, v in policy.items() if k not in environ}
    if added and "OMP_NUM_THREADS" not in policy:
        added[PIPELINE_ONLY] = ",".join(added)
    return added


def asks_only_help(argv: list[str]) -> bool:
    """Whether the command line asks for help or the version (or nothing): no thread of it
    computes, so the idle cores need no probe."""
    return not argv or any(arg in ("-h", "--help", "--version") for arg in argv)


def runs_two_units(argv: list[str]) -> bool:
    """Whether the command may run two compute units side by side: the engine with `--units
    split`, or a bench, whose children decide for themselves (child.py)."""
    return argv[:1] == ["bench"] or _flag(argv, "--units") == "split"


def _flag(argv: list[str], name: str) -> str | None:
    """The value of `name VALUE` or `name=VALUE` in argv (the last one), else None."""
    value = None
    for arg, following in zip(argv, [*argv[1:], None], strict=False):  # none when argv is empty
        if arg == name:
            value = following
        elif arg.startswith(name + "="):
            value = arg.partition("=")[2]
    return value


def one_stream_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a child process that computes with one OpenMP team (a memory-resident
    baseline, a peer, the engine with one unit): without what was set for two units only."""
    dropped = {PIPELINE_ONLY, *environ.get(PIPELINE_ONLY, "").split(",")}
    return {k: v for k, v in environ.items() if k not in dropped}


def defer_policy(settle: Callable[[], None]) -> None:
    """launch.py's, for a command that loads OpenMP only after reading its inputs: `settle`
    sets the policy when `settle_policy` is first called."""
    with _pending_lock:
        _pending.append(settle)


def settle_policy() -> None:
    """Before OpenMP loads: the policy launch.py deferred, set now (a no-op where none is
    pending, as in a library user's process)."""
    with _pending_lock:
        while _pending:
            _pending.pop()()


def on_a_thread_of_its_own(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) on a thread that ends with it; its result, or its exception raised here.
    For torch work outside the engine (a GGUF's conversion on first use): an OpenMP team
    that torch starts on a thread that lives on, as the main thread does, stays beside the
    engine's, and libgomp then sleeps every team's threads between products (the resident
    target decoded at 12-19 tok/s after a product on the main thread, 27-31 after one on a
    thread that ended; Zen 4, 2026-12-08). The thread is a daemon, so that Ctrl-C ends the
    process at once (the next run removes what a conversion half wrote)."""
    done: list[outcome.Outcome[T]] = []
    thread = threading.Thread(
        target=lambda: done.append(outcome.capture(fn, *args)), name="own-team", daemon=True
    )
    thread.start()
    thread.join()
    return done[0].unwrap()
