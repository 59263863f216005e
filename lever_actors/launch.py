"""The `lever-actors` console entry point: OpenMP's thread policy (threads.py), set before the
CLI loads torch, because OpenMP reads it only once, when it loads."""

import importlib
import os
import sys
import threading

from lever_actors.threads import asks_only_help, idle_cores, thread_policy

# what the CLI imports that loads no OpenMP runtime: imported while the probe watches
BEFORE_OPENMP = ("trio", "msgspec", "lever_actors.cli")


def _probe_while_importing() -> int | None:
    """The idle-core probe (0.3 s, mostly asleep) on a thread, these imports meanwhile."""
    found: list[int | None] = [None]

    def probe() -> None:
        found[0] = idle_cores()

    thread = threading.Thread(target=probe, name="idle-cores")
    thread.start()
    for module in BEFORE_OPENMP:
        importlib.import_module(module)
    thread.join()
    return found[0]


_quick = "OMP_NUM_THREADS" in os.environ or asks_only_help(sys.argv[1:])
_probed = None if _quick else _probe_while_importing()
os.environ.update(thread_policy(os.environ, _probed, os.cpu_count() or 1, sys.argv[1:]))

from lever_actors.cli import main  # noqa: E402  (after the thread policy, which torch reads on load)

__all__ = ["main"]
