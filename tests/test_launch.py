"""The console entry point's thread policy: set before torch loads, never over the user's;
undone for a child that computes with one OpenMP team where it was set for two units only."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from lever_actors.launch import BEFORE_OPENMP
from lever_actors.model import plain
from lever_actors.threads import (
    PIPELINE_ONLY,
    cores_left,
    idle_cores,
    on_a_thread_of_its_own,
    one_stream_environ,
    thread_policy,
)

SHOW = (
    "import os, sys; sys.argv = ['lever-actors', *sys.argv[1:]]; import lever_actors.launch; "
    "print(*(os.environ.get(k, '-') for k in ('OMP_WAIT_POLICY', 'OMP_NUM_THREADS')))"
)
ONE_UNIT = ["generate", "--chat", "hi"]  # the engine's default: every job on one thread
PIPELINE = [*ONE_UNIT, "--units", "split"]  # two compute units
ONE_STREAM = ["generate", "--model", "m.gguf"]


def launched(env: dict[str, str], argv: list[str]) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    done = subprocess.run(
        [sys.executable, "-c", SHOW, *argv],
        env=clean | env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.split()


def test_the_users_settings_are_kept():
    mine = {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "3"}
    assert launched(mine, PIPELINE) == ["ACTIVE", "3"]
    assert thread_policy({"OMP_WAIT_POLICY": "ACTIVE"}, 1, 2, PIPELINE) == {"OMP_NUM_THREADS": "1"}


def test_two_units_sleep_their_idle_threads():
    assert launched({"OMP_NUM_THREADS": "2"}, PIPELINE) == ["PASSIVE", "2"]
    assert thread_policy({}, free=2, cores=2, argv=PIPELINE) == {
        "OMP_WAIT_POLICY": "PASSIVE",
        PIPELINE_ONLY: "OMP_WAIT_POLICY",
    }


def test_one_team_on_an_idle_machine_keeps_torchs_default():
    assert launched({"OMP_NUM_THREADS": "2"}, ONE_STREAM) == ["-", "2"]
    assert launched({"OMP_NUM_THREADS": "2"}, ONE_UNIT) == ["-", "2"]
    assert thread_policy({}, free=2, cores=2, argv=ONE_STREAM) == {}
    assert thread_policy({}, free=None, cores=2, argv=["generate", "--model=m"]) == {}
    assert thread_policy({}, free=2, cores=2, argv=[*ONE_UNIT, "--units=single"]) == {}
    assert thread_policy({}, free=2, cores=2, argv=[*PIPELINE, "--units=single"]) == {}


def test_no_arguments_at_all_get_no_policy():
    """`lever-actors` alone prints its usage: nothing to set up for."""
    assert thread_policy({}, free=2, cores=2, argv=[]) == {}


def test_two_units_and_a_bench_sleep_idle_threads():
    two = {"OMP_WAIT_POLICY": "PASSIVE", PIPELINE_ONLY: "OMP_WAIT_POLICY"}
    assert thread_policy({}, free=2, cores=2, argv=["serve", "l", "--units=split"]) == two
    assert thread_policy({}, free=2, cores=2, argv=["serve", "l", "--units", "split"]) == two
    assert thread_policy({}, free=2, cores=2, argv=["serve", "l"]) == {}
    assert thread_policy({}, free=2, cores=2, argv=["bench", "--modes", "lever"]) == two


def test_a_busy_machine_gets_the_idle_cores_and_sleeping_threads():
    busy = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_policy({}, free=1, cores=2, argv=PIPELINE) == busy
    assert thread_policy({}, free=1, cores=2, argv=ONE_STREAM) == busy


def test_a_busy_neighbour_takes_a_core_from_the_count():
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert idle_cores(3, 0.2) <= (os.cpu_count() or 1) - 1
    finally:
        neighbour.kill()
        neighbour.wait()


def test_the_probes_own_process_is_not_a_neighbour():
    # two cores, windows of 10 ticks each: (busy of all processes, all, ours)
    ours_busy = [(0, 0, 0), (10, 20, 10), (20, 40, 20), (30, 60, 30)]
    assert cores_left(ours_busy, cores=2) == 2
    neighbour = [(0, 0, 0), (18, 20, 10), (36, 40, 20), (54, 60, 30)]  # 8 of 10 ticks
    assert cores_left(neighbour, cores=2) == 1
    just_exited = [(0, 0, 0), (18, 20, 0), (20, 40, 0), (22, 60, 0)]  # busy in one window
    assert cores_left(just_exited, cores=2) == 2
    assert cores_left([(5, 7, 0)], cores=2) is None


def test_what_imports_beside_the_probe_loads_no_openmp():
    code = (
        f"import importlib, sys; [importlib.import_module(m) for m in {BEFORE_OPENMP!r}]; "
        "maps = open('/proc/self/maps').read(); "
        "print('torch' in sys.modules, 'numpy' in sys.modules, 'gomp' in maps or 'libomp' in maps)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False", "False"]


def test_a_one_stream_child_goes_without_what_was_set_for_the_pipeline_only():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "2"}
    ours = base | thread_policy(base, free=2, cores=2, argv=PIPELINE)
    assert ours["OMP_WAIT_POLICY"] == "PASSIVE"
    assert one_stream_environ(ours) == base


def test_a_one_stream_child_keeps_the_users_policy_and_a_busy_machines():
    users = {"OMP_WAIT_POLICY": "PASSIVE"}
    assert one_stream_environ(users | thread_policy(users, 2, 2, PIPELINE)) == users
    busy = thread_policy({}, free=1, cores=2, argv=PIPELINE)
    assert one_stream_environ(busy) == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def test_the_console_script_ends_with_mains_code_its_output_and_atexit_handlers():
    code = (
        "import atexit, sys, threading, time; import lever_actors.launch as launch\n"
        "atexit.register(print, 'atexit ran')\n"
        "late = threading.Thread(target=lambda: (time.sleep(0.2), print('thread done')))\n"
        "launch.main = lambda: (late.start(), sys.stdout.write('x' * 100000), 3)[2]\n"
        "launch.console()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 3
    assert done.stdout == "x" * 100000 + "thread done\natexit ran\n"


@pytest.mark.skipif(not plain.available(), reason="this CPU cannot run the plain kernels")
def test_generate_sets_the_policy_only_as_openmp_loads_with_the_plain_kernels():
    """The probe runs on while generate reads its tokenizer and weights."""
    code = (
        "import os, sys; sys.argv = ['lever-actors', '-v', *sys.argv[1:]]; "
        "import lever_actors.launch; print(os.environ.get('OMP_WAIT_POLICY', '-')); "
        "from lever_actors.model import plain; plain.available(); "
        "print(os.environ.get('OMP_WAIT_POLICY', '-'))"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    done = subprocess.run(
        [sys.executable, "-c", code, *PIPELINE], env=clean, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["-", "PASSIVE"]  # two units sleep their idle threads


def test_only_generate_defers_its_policy():
    # --cache-dir's value is a path, never the command (cli/commands.py's command_in)
    argv = ["--cache-dir", "generate", "serve", "l", "--units", "split"]
    assert launched({}, argv)[0] == "PASSIVE"


def test_work_on_a_thread_of_its_own_returns_or_raises_here_once_its_thread_ended():
    ran_on: list[threading.Thread] = []

    def work(value: int) -> int:
        ran_on.append(threading.current_thread())
        if value < 0:
            raise ValueError(f"no {value}")
        return value * 2

    assert on_a_thread_of_its_own(work, 21) == 42
    with pytest.raises(ValueError, match="^no -1$"):
        on_a_thread_of_its_own(work, -1)
    assert len(ran_on) == 2 and threading.current_thread() not in ran_on
    assert not any(thread.is_alive() for thread in ran_on)
