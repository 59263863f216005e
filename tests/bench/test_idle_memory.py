"""benchmarks/idle_memory.py's reading of /proc/PID/status (the script itself needs the real
pair, and runs as a process of its own)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "idle_memory.py"


def _script():
    spec = importlib.util.spec_from_file_location("idle_memory", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STATUS = """Name:\tpython
Umask:\t0022
State:\tS (sleeping)
VmHWM:\t  912340 kB
VmRSS:\t  811008 kB
RssAnon:\t  600000 kB
RssFile:\t  211000 kB
RssShmem:\t       8 kB
Threads:\t5
"""


def test_status_fields_in_bytes_and_only_those_asked():
    idle = _script()
    fields = idle.status_fields(STATUS)
    assert fields == {
        "VmHWM": 912340 * 1024,
        "VmRSS": 811008 * 1024,
        "RssAnon": 600000 * 1024,
        "RssFile": 211000 * 1024,
        "RssShmem": 8 * 1024,
    }
    assert idle.status_fields(STATUS, ("RssAnon",)) == {"RssAnon": 600000 * 1024}
    assert idle.status_fields("RssAnon:\tmany kB\nRssFile: 12 MB\n") == {}  # not kB counts


def test_this_process_has_anonymous_and_file_pages():
    fields = _script().sample()
    assert fields["RssAnon"] > 0 and fields["RssFile"] > 0
    assert fields["VmRSS"] >= fields["RssAnon"]
