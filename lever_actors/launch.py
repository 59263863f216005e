"""The `lever-actors` console entry point: OpenMP's thread policy (threads.py), set before the
CLI loads torch, because OpenMP reads it only once, when it loads."""

import os
import sys

from lever_actors.threads import asks_only_help, idle_cores, thread_policy

_quick = "OMP_NUM_THREADS" in os.environ or asks_only_help(sys.argv[1:])
_probed = None if _quick else idle_cores()
os.environ.update(thread_policy(os.environ, _probed, os.cpu_count() or 1, sys.argv[1:]))

from lever_actors.cli import main  # noqa: E402  (after the thread policy, which torch reads on load)

__all__ = ["main"]
