"""A stand-in for llama-server: /health (503 while it "loads") and streamed POST
/completion answers shaped as llama.cpp 11434's (server-sent events in chunked transfer
encoding, `tokens` in each chunk, `stop_type` and `timings` in the last). Served from a
thread in a test, or run as a program with llama-server's command line."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

EOS = 96  # the end token it stops at (not streamed, as llama-server does)
DIE = 13  # asked for this many tokens, it dies mid-request, as one killed by its limit


def reply(prompt: list[int], n_predict: int) -> list[list[int]]:
    """The tokens it streams for a prompt, chunk by chunk: two in the first (as a drafted
    step gives), then one each; n_predict - 1 in all, then it stops at its end token."""
    tokens = [(sum(prompt) + i) % EOS for i in range(n_predict - 1)]
    return [tokens[:2]] + [[t] for t in tokens[2:]]


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int = 0, *, together: int = 1, load_s: float = 0.0) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.ready_at = time.monotonic() + load_s
        # each request waits for `together` of them to have arrived: sent one after the
        # other, they would time out
        self.barrier = threading.Barrier(together, timeout=10)
        self.bodies: list[dict] = []

    @property
    def port(self) -> int:
        return self.server_address[1]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeServer

    def do_GET(self) -> None:
        ready = time.monotonic() >= self.server.ready_at
        self._send(200 if ready else 503, b'{"status": "ok"}' if ready else b"{}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        try:
            self.server.barrier.wait()
        except threading.BrokenBarrierError:
            self._send(500, b"requests came one after the other")
            return
        if body["n_predict"] == DIE:
            print("ggml: error: out of memory", file=sys.stderr, flush=True)
            os._exit(3)
        if not body["prompt"]:
            self._send(400, b'{"error": {"message": "empty prompt"}}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunks = reply(body["prompt"], body["n_predict"])
        for tokens in chunks:
            self._event({"content": "x" * len(tokens), "tokens": tokens, "stop": False})
            time.sleep(0.005)
        predicted = sum(map(len, chunks))
        timings = {"prompt_n": len(body["prompt"]), "predicted_n": predicted, "prompt_ms": 1.5}
        self._event({"tokens": [], "stop": True, "stop_type": "eos", "timings": timings})
        self.wfile.write(b"0\r\n\r\n")

    def _event(self, chunk: dict) -> None:
        data = f"data: {json.dumps(chunk)}\n\n".encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass  # quiet, as the bench runs it


def main(argv: list[str]) -> int:
    """As llama-server: -m MODEL, --port P, -np N (the requests each waits for)."""
    model = Path(argv[argv.index("-m") + 1])
    if not model.is_file():
        print(f"llama_model_load: error loading model: no file {model}", file=sys.stderr)
        return 1
    port, slots = int(argv[argv.index("--port") + 1]), int(argv[argv.index("-np") + 1])
    FakeServer(port, together=slots, load_s=0.3).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
