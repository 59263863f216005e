"""One benchmark mode in its own process: `python -m lever_actors.bench.child`.

The harness starts the child, moves it into a memory cgroup, and only then sends the first
request, so that everything the mode loads is charged to the cgroup: the child imports
nothing but the standard library until that request arrives. The messages are in
bench/protocol.py; the child's own prints and logs go to stderr; end of input ends it.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import AsyncExitStack


def main() -> int:
    protocol_out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints of libraries must not corrupt the protocol
    first = sys.stdin.buffer.readline()
    if not first:
        return 0
    import trio

    return trio.run(_serve, first, protocol_out)


async def _serve(first: bytes, out) -> int:
    import msgspec
    import trio

    from lever_actors.bench import protocol as p
    from lever_actors.bench.isolation import peak_rss_bytes
    from lever_actors.bench.specs import open_in_process

    encoder = msgspec.json.Encoder()
    decoder = msgspec.json.Decoder(p.Request)

    def send(message) -> None:
        out.write(encoder.encode(message) + b"\n")

    request = decoder.decode(first)
    if not isinstance(request, p.Open):
        send(p.Failure("the first request must be Open"))
        return 2
    async with AsyncExitStack() as stack:
        try:
            mode = open_in_process(request.planned, drafts={})
            await mode.open(stack)
        except Exception as e:  # the parent records the mode as failed with this text
            send(p.Failure(describe(e)))
            return 1
        send(p.Opened(peak_rss_bytes(), mode.info.note))
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.buffer.readline)
            if not line:
                return 0
            request = decoder.decode(line)
            if not isinstance(request, p.Decode):
                send(p.Failure("expected a Decode request"))
                return 2
            started = time.perf_counter()
            try:
                decoded = await mode.decode(
                    request.prompt, request.max_new_tokens, frozenset(request.stop_ids)
                )
            except Exception as e:
                send(p.Failure(describe(e)))
                return 1
            decoded.peak_rss_bytes = peak_rss_bytes()
            send(p.Result(decoded, started))


def describe(error: BaseException) -> str:
    """An error as the results show it: type and message, first line only if very long."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 500 else text[:497] + "..."


if __name__ == "__main__":
    sys.exit(main())
