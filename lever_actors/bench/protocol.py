"""Messages between the harness and a mode's child process (bench/child.py): msgspec JSON,
one per line. stdin: Open(spec), then Decode requests; stdout: Opened, Result or Failure."""

from __future__ import annotations

import msgspec

from lever_actors.bench.modes import Decoded
from lever_actors.bench.specs import PlannedMode


class Open(msgspec.Struct, frozen=True, tag="open"):
    """harness -> child: load this mode."""

    planned: PlannedMode


class Decode(msgspec.Struct, frozen=True, tag="decode"):
    """harness -> child: decode one prompt."""

    prompt: list[int]
    max_new_tokens: int
    stop_ids: list[int]


class Opened(msgspec.Struct, frozen=True, tag="opened"):
    """child -> harness: the mode is loaded."""

    peak_rss_bytes: int
    note: str | None = None  # the mode's ModeInfo.note after opening


class Result(msgspec.Struct, frozen=True, tag="result"):
    """child -> harness: one prompt decoded."""

    decoded: Decoded
    started: float  # the child's perf_counter() when the request arrived


class Failure(msgspec.Struct, frozen=True, tag="failed"):
    """child -> harness: the request failed; the child exits after sending it."""

    error: str


Request = Open | Decode
Response = Opened | Result | Failure
