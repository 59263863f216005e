"""Byte sizes as people write them ('1.5GiB', '800MB') and as we print them."""

from __future__ import annotations

import math
import re

from lever_actors.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int) -> int:
    """'1.5GiB', '800MB', '123' -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read {text!r} as a size; use e.g. 1.5GiB, 800MB or 123456")
    size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(size):  # a few hundred digits read as inf
        raise ConfigError(f"{text!r} is too large a size")
    return int(size)


def format_bytes(n: int) -> str:
    """For people: '1.50 GiB', '12.3 MiB', '4.0 KiB'."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB"


def compact_bytes(n: int) -> str:
    """For labels that `parse_bytes` reads back exactly: '1.5GiB', '800MiB', '123'."""
    for name, unit in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= unit and (n * 100) % unit == 0:
            return f"{n / unit:g}{name}"
    return str(n)
