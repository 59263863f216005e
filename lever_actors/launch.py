"""The `lever-actors` console entry point: idle OpenMP threads sleep rather than spin
(device/threads.py says why), set here before the CLI loads torch, because OpenMP reads
the setting only once, when it loads. A value the user set is kept."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from lever_actors.cli import main  # noqa: E402  (after the wait policy, which torch reads on load)

__all__ = ["main"]
