"""The `lever-actors` console entry point: OpenMP's thread policy (threads.py), set before the
CLI loads torch or the plain kernels, because OpenMP reads it only once, when it loads."""

import atexit
import importlib
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

from lever_actors.threads import asks_only_help, defer_policy, idle_cores, thread_policy

# what the CLI imports that loads no OpenMP runtime: imported while the probe watches
BEFORE_OPENMP = ("trio", "msgspec", "lever_actors.cli")


def _probe_while_importing() -> Callable[[], int | None]:
    """The idle-core probe (0.3 s, mostly asleep) started on a thread, these imports
    meanwhile -> a call that waits for its finding."""
    found: list[int | None] = [None]

    def probe() -> None:
        found[0] = idle_cores()

    thread = threading.Thread(target=probe, name="idle-cores")
    thread.start()
    for module in BEFORE_OPENMP:
        importlib.import_module(module)

    def finding() -> int | None:
        thread.join()
        return found[0]

    return finding


def _set_policy(free: int | None) -> None:
    os.environ.update(thread_policy(os.environ, free, os.cpu_count() or 1, sys.argv[1:]))


if "OMP_NUM_THREADS" in os.environ or asks_only_help(sys.argv[1:]):
    _set_policy(None)
else:
    _finding = _probe_while_importing()
    from lever_actors.cli.commands import command_in  # imported beside the probe

    if command_in(sys.argv[1:]) == "generate":  # the probe runs on while it reads its inputs
        defer_policy(lambda: _set_policy(_finding()))
    else:
        _set_policy(_finding())

from lever_actors.cli import main  # noqa: E402  (after the thread policy, which torch reads on load)


def console() -> NoReturn:
    """The console script: the CLI, then, its threads joined, atexit's handlers run and its
    streams flushed, the process ends without the interpreter's teardown (torch's modules
    take 0.45 s to finalize)."""
    code = main()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a closed pipe or a full disk: what was written is lost
            code = code or 1
    os._exit(code)


__all__ = ["console", "main"]
