"""The harness's side of a mode run in a child process (bench/child.py), under a memory
cgroup when the machine offers one: a Mode like the in-process ones."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import AsyncExitStack

import msgspec
import trio

from lever_actors.bench import protocol as p
from lever_actors.bench.isolation import CgroupSupport, MemoryCgroup
from lever_actors.bench.modes import Decoded, ModeFailed
from lever_actors.bench.specs import PlannedMode
from lever_actors.device.budget import format_bytes


class ChildMode:
    def __init__(
        self,
        planned: PlannedMode,
        cgroups: CgroupSupport | None = None,
        *,
        python: str = sys.executable,
    ) -> None:
        self.planned = planned
        self.info = msgspec.structs.replace(planned.info, isolated=True)
        self.cgroups = cgroups  # None: no memory limit, peak RSS only
        self.python = python
        self.process: subprocess.Popen | None = None
        self.cgroup: MemoryCgroup | None = None
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(p.Response)

    @property
    def name(self) -> str:
        return self.info.name

    async def open(self, stack: AsyncExitStack) -> None:
        limit = self.info.memory_limit_bytes
        if limit is not None and self.cgroups is not None and self.cgroups.usable:
            self.cgroup = MemoryCgroup(self.cgroups, f"lever-bench-{os.getpid()}-{id(self)}", limit)
            stack.callback(self.cgroup.remove)
        self.process = subprocess.Popen(
            [self.python, "-m", "lever_actors.bench.child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        stack.push_async_callback(self._close)
        if self.cgroup is not None:
            self.cgroup.add(self.process.pid)  # before the first request: nothing loaded yet
        self.info = msgspec.structs.replace(
            self.info,
            memory_limit_bytes=self.cgroup.limit_bytes if self.cgroup else limit,
            limit_enforced=self.cgroup is not None,
        )
        response = await self._request(p.Open(self.planned))
        if isinstance(response, p.Failure):
            raise ModeFailed(response.error)
        if isinstance(response, p.Opened) and response.note:
            self.info = msgspec.structs.replace(self.info, note=response.note)

    async def decode(
        self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int]
    ) -> Decoded:
        t0 = time.perf_counter()
        response = await self._request(p.Decode(list(prompt), max_new_tokens, sorted(stop_ids)))
        if isinstance(response, p.Failure):
            raise ModeFailed(response.error)
        if not isinstance(response, p.Result):
            raise ModeFailed(f"child answered {type(response).__name__} to a Decode request")
        decoded = response.decoded
        # stamps on the child's clock, made to count from our t0
        decoded.stamps = [t0 + (s - response.started) for s in decoded.stamps]
        if self.cgroup is not None:
            decoded.cgroup_peak_bytes = self.cgroup.peak_bytes()
        return decoded

    async def _request(self, message: p.Open | p.Decode) -> p.Opened | p.Result | p.Failure:
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
