"""llama.cpp's server as the concurrency benchmark's peer: `llama-server -np N` decodes N
requests at once (continuous batching), with or without its draft model.

The server runs as a process of its own, moved into its memory cgroup before it executes,
its GGUFs evicted from the page cache first (as bench/llamacpp.py runs llama.cpp's other
programs). Requests go to its native `POST /completion` as token ids (no tokenizing again),
streamed, greedy, with its prompt cache off; each streamed chunk is stamped on arrival, and
its tokens (`return_tokens`) and final `timings` are read back. Only the standard library
speaks HTTP here: the bench needs no client package.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from lever_actors.bench.isolation import MemoryCgroup
from lever_actors.bench.llamacpp import LlamaCppSpec, failure, in_cgroup
from lever_actors.bench.mode import ModeFailed
from lever_actors.bench.together import at_once
from lever_actors.threads import one_stream_environ

HOST = "127.0.0.1"
START_TIMEOUT_S = 600.0  # loading under a tight limit pages its weights in slowly
REQUEST_TIMEOUT_S = 3600.0  # one request; llama.cpp runs about 1 tok/s under 1 GiB
STOP_TIMEOUT_S = 30.0  # after SIGTERM, before SIGKILL


def server_command(spec: LlamaCppSpec, port: int, parallel: int, slot_context: int) -> list[str]:
    """llama-server with `parallel` slots of `slot_context` tokens each (-c is shared out
    among the slots), greedy requests on `spec.threads` threads; with `spec.draft`, its draft
    model drafting up to `spec.draft_max` tokens. Its prompt cache in RAM is off (-cram 0):
    the requests ask for none, and under a limit it would hold memory for nothing."""
    argv = [spec.program, "-m", spec.model, "--host", HOST, "--port", str(port)]
    argv += ["-np", str(parallel), "-c", str(parallel * slot_context)]
    argv += ["-t", str(spec.threads), "--cache-ram", "0"]
    if spec.draft is not None:
        argv += ["-md", spec.draft, "--spec-type", "draft-simple"]
        argv += ["--spec-draft-n-max", str(spec.draft_max)]
    return argv


def free_port() -> int:
    """A TCP port no one listens on now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Completion:
    """One request's answer: its tokens, each stamped (perf_counter()) when its chunk came,
    how many came in the first chunk, when it was sent and when its answer ended, why it
    stopped ("eos", "limit", ...) and the server's own timings of it."""

    tokens: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)
    first_step_tokens: int = 0
    started: float = 0.0
    ended: float = 0.0
    stop_type: str | None = None
    timings: dict[str, float | int] = field(default_factory=dict)


def complete(port: int, prompt: list[int], n_predict: int) -> Completion:
    """One streamed greedy completion of `prompt` (token ids) from the server at `port`;
    blocks until its answer ends. A refusal, a broken answer or an error chunk raises
    ModeFailed."""
    body = {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0,
        "cache_prompt": False,
        "stream": True,
        "return_tokens": True,
    }
    connection = http.client.HTTPConnection(HOST, port, timeout=REQUEST_TIMEOUT_S)
    done = Completion(started=time.perf_counter())
    try:
        headers = {"Content-Type": "application/json"}
        connection.request("POST", "/completion", json.dumps(body).encode(), headers)
        response = connection.getresponse()
        if response.status != 200:
            text = response.read(500).decode(errors="replace")
            raise ModeFailed(f"llama-server answered {response.status}: {text}")
        for line in response:  # server-sent events: "data: {...}" lines
            if line.startswith(b"data: "):
                _take(done, json.loads(line[6:]), time.perf_counter())
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise ModeFailed(f"llama-server request failed: {type(e).__name__}: {e}") from None
    finally:
        connection.close()
    done.ended = time.perf_counter()
    return done


def _take(done: Completion, chunk: dict, now: float) -> None:
    """One streamed chunk into `done`."""
    if "error" in chunk:
        raise ModeFailed(f"llama-server: {chunk['error'].get('message', chunk['error'])}")
    tokens = chunk.get("tokens") or []
    if tokens and not done.tokens:
        done.first_step_tokens = len(tokens)
    done.tokens += tokens
    done.stamps += [now] * len(tokens)
    if chunk.get("stop"):
        done.stop_type = chunk.get("stop_type")
        done.timings = {
            k: v
            for k, v in (chunk.get("timings") or {}).items()
            if isinstance(v, int | float) and math.isfinite(v)
        }


async def complete_together(
    port: int, prompts: list[list[int]], n_predict: int
) -> list[Completion]:
    """Every prompt sent at once, one connection each, as concurrent clients would; the
    first failure is raised as itself."""
    done = [Completion() for _ in prompts]

    async def one(i: int) -> None:
        done[i] = await trio.to_thread.run_sync(complete, port, prompts[i], n_predict)

    await at_once(len(prompts), one)
    return done


def healthy(port: int) -> bool:
    """Whether the server answers GET /health with 200 (503 while it loads)."""
    connection = http.client.HTTPConnection(HOST, port, timeout=1.0)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


@asynccontextmanager
async def running_server(
    argv: list[str], port: int, cgroup: MemoryCgroup | None
) -> AsyncIterator[subprocess.Popen]:
    """The server of `argv`, listening on `port`, under `cgroup` from its first instruction;
    yields its process once it is healthy and stops it at the end of the block. One that
    exits or does not get healthy within START_TIMEOUT_S raises ModeFailed."""
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            in_cgroup(argv, cgroup),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=one_stream_environ(os.environ),  # its OpenMP as its own default has it
        )

        def died() -> ModeFailed:
            """Why it exited: its cgroup's OOM kill, else its last error line."""
            log.seek(0)
            stderr = log.read().decode(errors="replace")
            return ModeFailed(failure(argv[0], process.returncode, stderr, cgroup))

        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not await trio.to_thread.run_sync(healthy, port):
                if process.poll() is not None:
                    raise died()
                if time.monotonic() > deadline:
                    raise ModeFailed(f"llama-server not healthy after {START_TIMEOUT_S:.0f} s")
                await trio.sleep(0.1)
            try:
                yield process
            except ModeFailed:
                if await trio.to_thread.run_sync(_exited, process):  # a request failed as it died
                    raise died() from None
                raise
        finally:
            process.terminate()
            try:
                await trio.to_thread.run_sync(process.wait, STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                await trio.to_thread.run_sync(process.wait)


def _exited(process: subprocess.Popen) -> bool:
    """Whether `process` has exited, or does within a moment (a killed server's sockets
    close as it exits, so a request can fail just before its status is there)."""
    try:
        process.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        return False
    return True
