"""The `lever-actors` console entry point: idle OpenMP threads sleep rather than spin, set
before the CLI loads torch, because OpenMP reads the setting only once, when it loads. A
value the user set is kept.

Why: spinning idle threads lose their time slices beside a busy process. On two cores
with one busy neighbour, memory-resident decoding ran at 2.44 tok/s with idle threads
sleeping against 1.50 spinning (`bench/thread_policy.py`, docs/status.md).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from lever_actors.cli import main  # noqa: E402  (after the wait policy, which torch reads on load)

__all__ = ["main"]
