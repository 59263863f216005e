"""A mode in a child process of its own, under a memory cgroup when the machine offers one:
the messages between harness and child, the child's loop, and ChildMode, the harness's side,
a Mode like the in-process ones.

The messages are msgspec JSON, one per line. stdin: Open(planned mode), then Decode or
DecodeTogether requests; end of input ends the child. stdout: Opened, Result, Together or
Failure; the child's own prints and logs go to stderr. The harness starts the child, moves
it into its cgroup, and only then sends Open, so that everything the mode loads is charged
to the cgroup.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import BinaryIO

import msgspec
import trio

from lever_actors.bench.isolation import CgroupSupport, MemoryCgroup, evict_from_page_cache
from lever_actors.bench.mode import Decoded, Mode, ModeFailed, describe
from lever_actors.bench.opening import open_in_process
from lever_actors.bench.results import ModeInfo
from lever_actors.bench.specs import EngineSpec, MemoryARSpec, ModeSpec, PlannedMode
from lever_actors.bench.together import Together, decode_together
from lever_actors.device.memory import anonymous_rss_bytes, file_rss_bytes, peak_rss_bytes
from lever_actors.model.sampling import Sampling
from lever_actors.sizes import format_bytes
from lever_actors.threads import one_stream_environ

# The child's program. It waits for Open before it imports this module (and, for a mode that
# computes on torch, torch with it): by then the harness has moved it into its cgroup, which
# is then charged for every import.
CHILD_PROGRAM = """
import os, sys
protocol_out = os.fdopen(os.dup(1), "wb", buffering=0)
os.dup2(2, 1)  # stray prints of libraries must not corrupt the protocol
first = sys.stdin.buffer.readline()
if first:
    from lever_actors.bench.child import serve
    sys.exit(serve(first, protocol_out))
"""


class Open(msgspec.Struct, frozen=True, tag="open"):
    """harness -> child: load this mode."""

    planned: PlannedMode


class Decode(msgspec.Struct, frozen=True, tag="decode"):
    """harness -> child: decode one prompt."""

    prompt: list[int]
    max_new_tokens: int
    stop_ids: list[int]
    sampling: Sampling


class DecodeTogether(msgspec.Struct, frozen=True, tag="decode-together"):
    """harness -> child: decode these prompts at once, a stream each (bench/together.py),
    each after its delay in seconds where `delays` gives one."""

    prompts: list[list[int]]
    max_new_tokens: int
    stop_ids: list[int]
    sampling: Sampling
    delays: list[float] = []


class Opened(msgspec.Struct, frozen=True, tag="opened"):
    """child -> harness: the mode is loaded."""

    peak_rss_bytes: int
    # the mode's ModeInfo after opening: what it found (a note, an engine's plan and budget)
    # and this process's resident memory before the first request
    info: ModeInfo


class Result(msgspec.Struct, frozen=True, tag="result"):
    """child -> harness: one prompt decoded."""

    decoded: Decoded
    started: float  # the child's perf_counter() when the request arrived


class Failure(msgspec.Struct, frozen=True, tag="failed"):
    """child -> harness: the request failed; the child exits after sending it."""

    error: str


Request = Open | Decode | DecodeTogether
Response = Opened | Result | Together | Failure


def serve(first: bytes, out: BinaryIO) -> int:
    """The child: answer `first` (an Open) and then every Decode until end of input."""
    return trio.run(_serve, first, out)


async def _serve(first: bytes, out: BinaryIO) -> int:
    encoder = msgspec.json.Encoder()
    decoder = msgspec.json.Decoder(Request)

    def send(message: Response) -> None:
        out.write(encoder.encode(message) + b"\n")

    request = decoder.decode(first)
    if not isinstance(request, Open):
        send(Failure("the first request must be Open"))
        return 2
    async with AsyncExitStack() as stack:
        try:
            mode = open_in_process(request.planned, drafts=None)
            await mode.open(stack)
        except Exception as e:  # the harness records the mode as failed with this text
            send(Failure(describe(e)))
            return 1
        send(Opened(peak_rss_bytes(), idle_info(mode)))
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.buffer.readline)
            if not line:
                return 0
            request = decoder.decode(line)
            if not isinstance(request, Decode | DecodeTogether):
                send(Failure("expected a Decode or DecodeTogether request"))
                return 2
            try:
                send(await _answer(mode, request))
            except Exception as e:
                send(Failure(describe(e)))
                return 1


async def _answer(mode: Mode, request: Decode | DecodeTogether) -> Result | Together:
    stop_ids = frozenset(request.stop_ids)
    if isinstance(request, DecodeTogether):
        together = await decode_together(
            mode,
            request.prompts,
            request.max_new_tokens,
            stop_ids,
            request.sampling,
            request.delays,
        )
        return msgspec.structs.replace(together, peak_rss_bytes=peak_rss_bytes())
    started = time.perf_counter()
    decoded = await mode.decode(request.prompt, request.max_new_tokens, stop_ids, request.sampling)
    decoded.peak_rss_bytes = peak_rss_bytes()
    return Result(decoded, started)


def idle_info(mode: Mode) -> ModeInfo:
    """An open mode's info with this process's RssAnon and RssFile now, once open and before
    its first request."""
    return msgspec.structs.replace(
        mode.info,
        idle_anon_rss_bytes=anonymous_rss_bytes(),
        idle_file_rss_bytes=file_rss_bytes(),
    )


class ChildMode:
    """The harness's side of a mode run in a child process; `cgroups` None: no memory limit,
    peak RSS only."""

    def __init__(
        self,
        planned: PlannedMode,
        cgroups: CgroupSupport | None = None,
        *,
        python: str = sys.executable,
    ) -> None:
        self.planned = planned
        self.info = msgspec.structs.replace(planned.info, isolated=True)
        self.cgroups = cgroups
        self.python = python
        self.process: subprocess.Popen | None = None
        self.cgroup: MemoryCgroup | None = None
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(Response)

    async def open(self, stack: AsyncExitStack) -> None:
        limit = self.info.memory_limit_bytes
        if limit is not None and self.cgroups is not None and self.cgroups.usable:
            self.cgroup = MemoryCgroup(self.cgroups, f"lever-bench-{os.getpid()}-{id(self)}", limit)
            stack.callback(self.cgroup.remove)
        # two compute units keep the policy set for them; one team alone spins (threads.py)
        spec = self.planned.spec
        two_units = isinstance(spec, EngineSpec) and spec.config.units == "split"
        self.process = subprocess.Popen(
            [self.python, "-c", CHILD_PROGRAM],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=None if two_units else one_stream_environ(os.environ),
        )
        stack.push_async_callback(self._close)
        if self.cgroup is not None:
            self.cgroup.add(self.process.pid)  # before the first request: nothing loaded yet
            # files it loads whole: read by it, not found cached, so its limit counts them
            evict_from_page_cache(_loaded_files(self.planned.spec))
        self.info = msgspec.structs.replace(
            self.info,
            memory_limit_bytes=self.cgroup.limit_bytes if self.cgroup else limit,
            limit_enforced=self.cgroup is not None,
        )
        response = await self._request(Open(self.planned))
        if isinstance(response, Failure):
            raise ModeFailed(response.error)
        if isinstance(response, Opened):  # the child's account, with what only we know
            self.info = msgspec.structs.replace(
                response.info,
                isolated=True,
                memory_limit_bytes=self.info.memory_limit_bytes,
                limit_enforced=self.info.limit_enforced,
            )

    async def decode(
        self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int], sampling: Sampling
    ) -> Decoded:
        t0 = time.perf_counter()
        request = Decode(list(prompt), max_new_tokens, sorted(stop_ids), sampling)
        response = await self._request(request)
        if isinstance(response, Failure):
            raise ModeFailed(response.error)
        if not isinstance(response, Result):
            raise ModeFailed(f"child answered {type(response).__name__} to a Decode request")
        decoded = response.decoded
        # stamps on the child's clock, made to count from our t0
        decoded.stamps = [t0 + (s - response.started) for s in decoded.stamps]
        if self.cgroup is not None:
            decoded.cgroup_peak_bytes = self.cgroup.peak_bytes()
        return decoded

    async def decode_together(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        stop_ids: frozenset[int],
        sampling: Sampling,
        delays: Sequence[float] = (),
    ) -> Together:
        """The prompts decoded at once in the child (each after its delay); times on the
        child's clock."""
        request = DecodeTogether(prompts, max_new_tokens, sorted(stop_ids), sampling, list(delays))
        response = await self._request(request)
        if isinstance(response, Failure):
            raise ModeFailed(response.error)
        if not isinstance(response, Together):
            raise ModeFailed(f"child answered {type(response).__name__} to DecodeTogether")
        peak = self.cgroup.peak_bytes() if self.cgroup is not None else None
        return msgspec.structs.replace(response, cgroup_peak_bytes=peak)

    async def _request(self, message: Request) -> Response:
        process = self.process
        assert process is not None and process.stdin and process.stdout
        try:
            process.stdin.write(self._encoder.encode(message) + b"\n")
            process.stdin.flush()
        except BrokenPipeError:
            raise ModeFailed(await self._death()) from None
        line = await trio.to_thread.run_sync(process.stdout.readline)
        if not line:
            raise ModeFailed(await self._death())
        try:
            return self._decoder.decode(line)
        except msgspec.DecodeError as e:
            raise ModeFailed(f"unreadable answer from the child: {e}") from None

    async def _death(self) -> str:
        """Why the child is gone."""
        assert self.process is not None
        code = await trio.to_thread.run_sync(self.process.wait)
        if self.cgroup is not None and self.cgroup.oom_kills():
            return (
                f"killed by the memory limit of {format_bytes(self.cgroup.limit_bytes)} "
                f"(cgroup OOM kill, exit status {code})"
            )
        if code < 0:
            return f"child process killed by {signal.Signals(-code).name}"
        return f"child process exited with code {code}"

    async def _close(self) -> None:
        process = self.process
        if process is None:
            return
        if process.stdin:
            try:
                process.stdin.close()  # end of input: the child closes its mode and exits
            except BrokenPipeError:
                pass
        with trio.move_on_after(60) as waiting:
            await trio.to_thread.run_sync(process.wait, abandon_on_cancel=True)
        if waiting.cancelled_caught:
            process.kill()
            await trio.to_thread.run_sync(process.wait)
        if process.stdout:
            process.stdout.close()


def _loaded_files(spec: ModeSpec) -> list[Path]:
    """The model files a mode reads whole into DRAM: the draft's, or a memory-resident
    target's (a flash layout's reads bypass the page cache anyway)."""
    path = spec.config.draft if isinstance(spec, EngineSpec) else None
    path = spec.target if isinstance(spec, MemoryARSpec) else path
    return [Path(path)] if path and Path(path).exists() else []
