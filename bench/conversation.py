"""A real app's session on the real pair, through `lever-actors serve` as apps meet it:
start-up to the first /health answer, a long prompt's time to first token, and a chat whose
history is resent every turn, with the prefix cache on (the default) and off
(`--prompt-cache 0`). Each server is a process of its own; the two runs alternate.

    .venv/bin/python bench/conversation.py [--tokens 48] [--repeats 1] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec

from lever_actors.bench.results import Machine

CLI = [sys.executable, "-c", "import sys; from lever_actors.launch import main; sys.exit(main())"]
PORT = 8766
# held out from every prompt set: the opening of a standard-library module, about 1,400
# tokens, as a user pastes a file and asks about it
LONG_PROMPT = Path(sys.base_prefix, "lib", "python3.11", "argparse.py")
LONG_CHARS = 6500
TURNS = [
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Now make it work for any number of sorted lists.",
    "Add type hints and a docstring.",
    "Write three pytest tests for it.",
]


def start_server(*flags: str) -> tuple[subprocess.Popen, float]:
    """A server and the seconds from its launch to its first /health answer."""
    launched = time.perf_counter()
    server = subprocess.Popen(
        [*CLI, "serve", "--port", str(PORT), *flags], stderr=subprocess.DEVNULL
    )
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=1)
            return server, time.perf_counter() - launched
        except httpx.TransportError:
            if server.poll() is not None:
                raise RuntimeError("serve exited") from None
            time.sleep(0.05)


def chat(messages: list[dict], tokens: int) -> dict:
    """One streamed chat completion: its text, time to first token, usage."""
    body = {
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, first, usage = [], None, {}
    sent = time.perf_counter()
    url = f"http://127.0.0.1:{PORT}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=900) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    first = first or time.perf_counter() - sent
                    text.append(choice["delta"]["content"])
    return {
        "text": "".join(text),
        "first_token_s": first,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
    }


def session(tokens: int, *flags: str) -> dict:
    server, startup = start_server(*flags)
    try:
        long_text = LONG_PROMPT.read_text()[:LONG_CHARS]
        question = f"{long_text}\n\nWhat does this module do? Answer in one sentence."
        long = chat([{"role": "user", "content": question}], tokens)
        messages: list[dict] = []
        turns = []
        for turn in TURNS:
            messages.append({"role": "user", "content": turn})
            answer = chat(messages, tokens)
            messages.append({"role": "assistant", "content": answer["text"]})
            turns.append(answer)
    finally:
        server.terminate()
        server.wait()
    return {"startup_s": startup, "long_prompt": long, "turns": turns}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1, help="pairs of sessions, alternating")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeats):
        cached = session(args.tokens)
        cold = session(args.tokens, "--prompt-cache", "0")
        runs.append({"prompt_cache": cached, "no_prompt_cache": cold})
        for name, run in (("cache", cached), ("no cache", cold)):
            ttft = ", ".join(f"{t['first_token_s']:.2f}" for t in run["turns"])
            cached_tokens = ", ".join(
                f"{t['cached_tokens']}/{t['prompt_tokens']}" for t in run["turns"]
            )
            long = run["long_prompt"]
            print(
                f"{name}: start-up {run['startup_s']:.1f} s; long prompt "
                f"{long['prompt_tokens']} tokens, first token {long['first_token_s']:.1f} s "
                f"({long['prompt_tokens'] / long['first_token_s']:.0f} tok/s); turns' first "
                f"token {ttft} s, cached {cached_tokens}",
                flush=True,
            )
        same = [a["text"] == b["text"] for a, b in zip(cached["turns"], cold["turns"], strict=True)]
        print(f"same text with and without the cache, turn by turn: {same}")
    if args.out:
        record = {"machine": msgspec.to_builtins(Machine.here()), "tokens": args.tokens}
        args.out.write_text(json.dumps(record | {"runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
