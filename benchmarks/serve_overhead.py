"""Time to first token and decode tok/s of one streamed chat completion through
`lever-actors serve`, against the same request through `lever-actors generate`, on the
real pair (each a process of its own, one after the other); or, with `--against DIR`,
`serve` of another checkout's lever_actors (say a `git worktree` of an older commit)
against this one's, to show what a change costs.

    .venv/bin/python benchmarks/serve_overhead.py [--tokens 64] [--port 8765] [--repeats N]
                                             [--against DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-c", "from lever_actors.launch import console; console()"]
PROMPT = "Write a Python function that checks whether a string is a palindrome."
BURST_SECONDS = 0.005  # tokens of one step reach the client within this of each other


def through_generate(tokens: int) -> dict:
    done = subprocess.run(
        [*CLI, "generate", "--chat", PROMPT, "--max-new-tokens", str(tokens), "--stats", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    stats = json.loads(done.stderr.strip().splitlines()[-1])
    return {
        "first_token_s": stats["first_token_seconds"],
        "decode_tok_s": stats["decode_tokens_per_second"],
        "text": done.stdout.rstrip("\n"),
    }


def through_serve(tokens: int, port: int, checkout: Path = REPO) -> dict:
    env = os.environ | {"PYTHONPATH": str(checkout)}  # its lever_actors, not the installed one
    server = subprocess.Popen(
        [*CLI, "serve", "--port", str(port)], stderr=subprocess.DEVNULL, env=env
    )
    base = f"http://127.0.0.1:{port}"
    try:
        while True:  # the engine loads first
            try:
                httpx.get(f"{base}/health", timeout=1)
                break
            except httpx.TransportError:
                if server.poll() is not None:
                    raise RuntimeError("serve exited") from None
                time.sleep(0.5)
        body = {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
        }
        stamps, text = [], []
        sent = time.perf_counter()
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if "content" in delta:
                    stamps.append(time.perf_counter())
                    text.append(delta["content"])
    finally:
        server.terminate()
        server.wait()
    # as generate counts it: the first step's tokens (arriving together) are not decoding
    first_step = sum(1 for t in stamps if t - stamps[0] < BURST_SECONDS)
    first_step_end = stamps[first_step - 1]
    return {
        "first_token_s": stamps[0] - sent,
        "decode_tok_s": (len(stamps) - first_step) / (stamps[-1] - first_step_end),
        "text": "".join(text),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs, alternating")
    parser.add_argument(
        "--against", type=Path, metavar="DIR", help="serve of this checkout instead of generate"
    )
    args = parser.parse_args()
    if args.against is None:
        names = ("generate", "serve")
        runs = (
            partial(through_generate, args.tokens),
            partial(through_serve, args.tokens, args.port),
        )
    else:
        names = (f"serve of {args.against}", "serve of this checkout")
        runs = (
            partial(through_serve, args.tokens, args.port, args.against.resolve()),
            partial(through_serve, args.tokens, args.port),
        )
    rows = []
    for _ in range(args.repeats):  # alternating, so that drift hits both alike
        rows.append(tuple(run() for run in runs))
        print(f"same text: {rows[-1][0]['text'] == rows[-1][1]['text']}")
        for key in ("first_token_s", "decode_tok_s"):
            figures = ", ".join(
                f"{name} {row[key]:.2f}" for name, row in zip(names, rows[-1], strict=True)
            )
            print(f"{key}: {figures}", flush=True)
    for key in ("first_token_s", "decode_tok_s"):
        means = [sum(row[i][key] for row in rows) / len(rows) for i in (0, 1)]
        print(
            f"mean {key}: " + ", ".join(f"{n} {m:.2f}" for n, m in zip(names, means, strict=True))
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
