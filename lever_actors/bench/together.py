"""Several prompts decoded at once by one mode: a stream each, started together in one
trio nursery, as concurrent clients would send them (or each after its delay). With an
engine mode, how many of them decode together is the engine's `EngineConfig.parallel`;
the rest wait for a place."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Protocol

import msgspec
import trio

from lever_actors.bench.mode import Decoded, Mode
from lever_actors.bench.results import ModeInfo
from lever_actors.model.sampling import Sampling


class Together(msgspec.Struct, frozen=True, tag="together"):
    """The prompts' outputs in their order, and when each request started and ended, on the
    decoding process's perf_counter() clock (as its stamps are)."""

    decoded: list[Decoded]
    started: list[float]
    ended: list[float]
    peak_rss_bytes: int | None = None  # of the process that decoded, so far
    cgroup_peak_bytes: int | None = None  # of the cgroup it ran in, so far


class DecodesTogether(Protocol):
    """A mode that decodes prompts at once (ChildMode: in its child, by decode_together)."""

    info: ModeInfo

    async def open(self, stack: AsyncExitStack) -> None: ...

    async def decode_together(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        stop_ids: frozenset[int],
        sampling: Sampling,
        delays: Sequence[float] = (),
    ) -> Together: ...


async def decode_together(
    mode: Mode,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    stop_ids: frozenset[int],
    sampling: Sampling,
    delays: Sequence[float] = (),
) -> Together:
    """Every prompt through `mode.decode` at once (`at_once`), each after its delay in
    seconds where `delays` gives one."""
    decoded = [Decoded() for _ in prompts]
    started = [0.0] * len(prompts)
    ended = [0.0] * len(prompts)

    async def one(i: int) -> None:
        if i < len(delays):
            await trio.sleep(delays[i])
        started[i] = time.perf_counter()
        decoded[i] = await mode.decode(prompts[i], max_new_tokens, stop_ids, sampling)
        ended[i] = time.perf_counter()

    await at_once(len(prompts), one)
    return Together(decoded, started, ended)


async def at_once(count: int, one: Callable[[int], Awaitable[None]]) -> None:
    """`one(0)` to `one(count - 1)` started together; the first error ends them all and is
    raised as itself (not in a group), so that the results show what went wrong."""
    try:
        async with trio.open_nursery() as nursery:
            for i in range(count):
                nursery.start_soon(one, i)
    except ExceptionGroup as group:
        raise first_error(group) from None


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first error in a (possibly nested) exception group."""
    inner = group.exceptions[0]
    return first_error(inner) if isinstance(inner, BaseExceptionGroup) else inner
