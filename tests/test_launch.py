"""The console entry point's thread policy: set before torch loads, never over the user's."""

from __future__ import annotations

import os
import subprocess
import sys

from lever_actors.launch import idle_cores

SHOW = (
    "import os, lever_actors.launch; "
    "print(os.environ['OMP_WAIT_POLICY'], os.environ.get('OMP_NUM_THREADS'))"
)


def launched(env: dict[str, str]) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    done = subprocess.run(
        [sys.executable, "-c", SHOW], env=clean | env, capture_output=True, text=True, check=True
    )
    return done.stdout.split()


def test_the_users_settings_are_kept():
    assert launched({"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "3"}) == ["ACTIVE", "3"]


def test_idle_threads_sleep_by_default():
    assert launched({})[0] == "PASSIVE"


def test_a_busy_neighbour_takes_a_core_from_the_count():
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert idle_cores(3, 0.2) <= (os.cpu_count() or 1) - 1
    finally:
        neighbour.kill()
        neighbour.wait()
