"""Bounded, typed channels between actors, opened by name, with statistics and tracing."""

from __future__ import annotations

from dataclasses import dataclass
from types import UnionType
from typing import Any, Generic, TypeVar

import trio

from lever_actors.channels.trace import Tracer

T = TypeVar("T")


@dataclass
class Channel(Generic[T]):
    name: str
    message_type: type | UnionType  # a message type, or a union of them
    send: Any  # trio.MemorySendChannel[T], or a tracing wrapper with the same methods
    receive: trio.MemoryReceiveChannel[T]


class ChannelSet:
    """Channels opened together: one request's, or those of the actors every request
    shares. Capacities are always explicit: nothing is unbounded."""

    def __init__(self, tracer: Tracer | None = None) -> None:
        self.channels: dict[str, Channel] = {}
        self.tracer = tracer  # records every message sent, where the engine traces

    def open(self, name: str, message_type: type | UnionType, capacity: int) -> Channel:
        if capacity < 1:
            raise ValueError(f"channel {name} needs a capacity of at least 1, got {capacity}")
        # message_type is known only at run time: to the type checker, any message
        send, receive = trio.open_memory_channel[Any](capacity)
        traced = send if self.tracer is None else self.tracer.wrap(name, send)
        channel = Channel(name, message_type, traced, receive)
        self.channels[name] = channel
        return channel

    def statistics(self) -> dict[str, trio.MemoryChannelStatistics]:
        return {name: c.receive.statistics() for name, c in self.channels.items()}
