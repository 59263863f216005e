"""This machine's CPU as /proc/cpuinfo lists it: the model's name and the first processor's
flags (the instruction sets it offers)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The first processor's model name; where /proc/cpuinfo is not there, platform's."""
    for key, value in _first_processor():
        if key == "model name":
            return value
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The flags of the first processor in /proc/cpuinfo (or of `cpuinfo`'s text)."""
    for key, value in _first_processor(cpuinfo):
        if key == "flags":
            return frozenset(value.split())
    return frozenset()


def _first_processor(cpuinfo: str | None = None) -> list[tuple[str, str]]:
    """(key, value) of /proc/cpuinfo's lines (or `cpuinfo`'s), the first of each key kept."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    seen: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        seen.setdefault(key.strip(), value.strip())
    return list(seen.items())
