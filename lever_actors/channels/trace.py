"""The trace codec: every message sent, one JSON record per line, tensors summarised.

Records decode back into typed `TraceRecord`s whose `message` is the original Struct type,
with each tensor field replaced by a `TensorSummary`-shaped dict.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import torch
import trio

from lever_actors.channels.messages import (
    Commit,
    DraftRequest,
    DraftRound,
    DraftTree,
    ExitProbe,
    FinalHidden,
    LayerWeights,
    LeaveSeat,
    PruneVerdict,
    SlotRelease,
    StepAside,
    TakeSeat,
    Verdict,
)

AnyMessage = (
    DraftRequest
    | DraftTree
    | LayerWeights
    | SlotRelease
    | ExitProbe
    | PruneVerdict
    | FinalHidden
    | Verdict
    | Commit
    | TakeSeat
    | LeaveSeat
    | StepAside
    | DraftRound
)


class TensorSummary(msgspec.Struct, frozen=True):
    shape: list[int]
    dtype: str


class TraceRecord(msgspec.Struct, frozen=True):
    seconds: float  # since the tracer opened
    channel: str
    message: AnyMessage


def _summarise(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    return type(value).__name__  # a seat's cache, channel ends and event: named only


class Tracer:
    def __init__(self, path: str | Path) -> None:
        self.file = open(path, "ab")  # noqa: SIM115 - closed with its engine (close)
        self.encoder = msgspec.json.Encoder(enc_hook=_summarise)
        self.started = time.perf_counter()

    def wrap(self, name: str, send) -> _TracedSend:
        return _TracedSend(self, name, send)

    def record(self, channel: str, message: Any) -> None:
        record = TraceRecord(time.perf_counter() - self.started, channel, message)
        self.file.write(self.encoder.encode(record) + b"\n")

    def close(self) -> None:
        self.file.close()


class _TracedSend:
    """A send channel end that records each message it sends."""

    def __init__(self, tracer: Tracer, name: str, inner) -> None:
        self.tracer, self.name, self.inner = tracer, name, inner

    async def send(self, message: Any) -> None:
        self.tracer.record(self.name, message)
        await self.inner.send(message)

    def clone(self) -> _TracedSend:
        """Another end of the same channel (trio's clone), traced under the same name."""
        return self.tracer.wrap(self.name, self.inner.clone())

    def send_nowait(self, message: Any) -> None:
        self.inner.send_nowait(message)
        self.tracer.record(self.name, message)

    def statistics(self) -> Any:
        """trio's figures of the channel (its open ends: whether anyone still listens)."""
        return self.inner.statistics()

    def close(self) -> None:
        self.inner.close()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()

    def __enter__(self) -> _TracedSend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_trace(path: str | Path) -> list[TraceRecord]:
    decoder = msgspec.json.Decoder(TraceRecord)
    return [decoder.decode(line) for line in Path(path).read_bytes().splitlines() if line]
