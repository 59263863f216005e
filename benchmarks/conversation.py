"""A real app's session on the real pair, through `lever-actors serve` as apps meet it:
start-up to the first /health answer, a long prompt's time to first token, and held-out
ShareGPT conversations sent turn by turn, each turn with the whole history (the model's
answers as assistant messages) as a chat UI does, with the prefix cache on (the default)
and off (`--prompt-cache 0`), and with --llama-server llama.cpp's server (its prompt cache
on, one slot) on the target's GGUF. Each server is a process of its own; the sessions
alternate; each conversation is a fresh history within the session. With --memory-limit
each server runs in a cgroup of that limit, the weight files evicted from the page cache
before it starts, and the results go to conversation-LIMIT.json (benchmarks/sessions_summary.py
reads them).

    .venv/bin/python benchmarks/conversation.py [--tokens 48] [--repeats 1] [--llama-server]
                                           [--conversations 5] [--turns 4]
                                           [--dram-budget B] [--memory-limit 1GiB] [--ctx-size N]
                                           [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path
from statistics import median

import httpx
import msgspec

from lever_actors.bench.isolation import MemoryCgroup, evict_from_page_cache, probe_cgroup
from lever_actors.bench.llamacpp_build import SERVER, find_build
from lever_actors.bench.results import Machine
from lever_actors.checkpoints.prompts import sharegpt_conversations
from lever_actors.checkpoints.real_pair import real_model_path, real_target_layout
from lever_actors.paths import default_cache_dir
from lever_actors.sizes import parse_bytes

CLI = [sys.executable, "-c", "from lever_actors.launch import console; console()"]
PORT = 8766
# held out from every prompt set: the opening of a standard-library module, about 1,400
# tokens, as a user pastes a file and asks about it
LONG_PROMPT = Path(sys.base_prefix, "lib", "python3.11", "argparse.py")
LONG_CHARS = 6500
RESULTS = Path(__file__).parent / "results"
BASE = f"http://127.0.0.1:{PORT}"


def lever_server(*flags: str) -> list[str]:
    return [*CLI, "serve", "--port", str(PORT), *flags]


def llama_server() -> list[str]:
    """llama-server on the target's GGUF, one slot, its prompt cache on (the default of
    `cache_prompt`), as many threads as ours."""
    build = find_build(default_cache_dir())
    if build is None:
        raise SystemExit("no llama.cpp build: run `lever-actors build-llamacpp` first")
    target = real_model_path(default_cache_dir(), "target")
    argv = [str(build.program(SERVER)), "-m", str(target), "--port", str(PORT)]
    return [*argv, "-c", "8192", "-t", "2", "-np", "1", "--log-disable"]


def start_server(argv: list[str], cgroup: MemoryCgroup | None) -> tuple[subprocess.Popen, float]:
    """A server and the seconds from its launch to its first ready /health answer; under
    `cgroup` from its first instruction, the weights out of the page cache before it."""
    cache = default_cache_dir()
    models = [real_model_path(cache, "target"), real_model_path(cache, "draft")]
    evict_from_page_cache([*models, real_target_layout(cache)])
    joined = (lambda: cgroup.add(os.getpid())) if cgroup else None
    launched = time.perf_counter()
    server = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=joined
    )
    while True:
        try:
            if httpx.get(f"{BASE}/health", timeout=1).status_code == 200:  # 503: loading
                return server, time.perf_counter() - launched
        except httpx.TransportError:
            pass
        if server.poll() is not None:
            raise RuntimeError(f"{Path(argv[0]).name} exited") from None
        time.sleep(0.05)


def chat(messages: list[dict], tokens: int) -> dict:
    """One streamed chat completion: its text, time to first token, usage (llama-server's
    cached count from its `timings`, where its usage has none)."""
    body = {
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, first, usage, timings = [], None, {}, {}
    sent = time.perf_counter()
    with httpx.stream("POST", f"{BASE}/v1/chat/completions", json=body, timeout=900) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    first = first or time.perf_counter() - sent
                    text.append(choice["delta"]["content"])
    details = usage.get("prompt_tokens_details") or {}
    return {
        "text": "".join(text),
        "first_token_s": first,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": details.get("cached_tokens", timings.get("cache_n")),
    }


def session(
    argv: list[str], conversations: list[list[str]], tokens: int, cgroup: MemoryCgroup | None
) -> dict:
    """One server's start-up, the long prompt, then each conversation from a fresh history:
    per conversation, its turns' answers."""
    server, startup = start_server(argv, cgroup)
    try:
        long_text = LONG_PROMPT.read_text()[:LONG_CHARS]
        question = f"{long_text}\n\nWhat does this module do? Answer in one sentence."
        long = chat([{"role": "user", "content": question}], tokens)
        answers = []
        for conversation in conversations:
            messages: list[dict] = []
            turns = []
            for turn in conversation:
                messages.append({"role": "user", "content": turn})
                answer = chat(messages, tokens)
                messages.append({"role": "assistant", "content": answer["text"]})
                turns.append(answer)
            answers.append(turns)
    finally:
        server.terminate()
        server.wait()
    return {"startup_s": startup, "long_prompt": long, "conversations": answers}


def summary(runs: list[dict]) -> dict:
    """Medians over the runs, conversations and their turns 2 on, where a cache can help;
    the share of turns whose texts with and without the cache are the same, the least of
    the runs'."""

    def later_ttft(name: str) -> float:
        return median(
            turn["first_token_s"]
            for run in runs
            for turns in run[name]["conversations"]
            for turn in turns[1:]
        )

    def agreement(run: dict) -> float:
        pairs = [
            (a["text"], b["text"])
            for cached, uncached in zip(
                run["prompt_cache"]["conversations"],
                run["no_prompt_cache"]["conversations"],
                strict=True,
            )
            for a, b in zip(cached, uncached, strict=True)
        ]
        return sum(a == b for a, b in pairs) / len(pairs)

    warm, cold = later_ttft("prompt_cache"), later_ttft("no_prompt_cache")
    figures = {
        "warm_ttft_over_cold": warm / cold,
        "startup_seconds": median(run["prompt_cache"]["startup_s"] for run in runs),
        "min_agreement": min(agreement(run) for run in runs),
    }
    if all("llama_server" in run for run in runs):
        figures["turn_ttft_vs_llamacpp_server"] = later_ttft("llama_server") / warm
    return figures


def report(name: str, run: dict) -> None:
    long = run["long_prompt"]
    print(
        f"{name}: start-up {run['startup_s']:.1f} s; long prompt "
        f"{long['prompt_tokens']} tokens, first token {long['first_token_s']:.1f} s "
        f"({long['prompt_tokens'] / long['first_token_s']:.0f} tok/s)",
        flush=True,
    )
    for i, turns in enumerate(run["conversations"]):
        ttft = ", ".join(f"{t['first_token_s']:.2f}" for t in turns)
        cached = ", ".join(f"{t['cached_tokens']}/{t['prompt_tokens']}" for t in turns)
        print(f"  conversation {i + 1}: first token {ttft} s, cached {cached}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of sessions, alternating")
    parser.add_argument(
        "--conversations", type=int, default=5, help="held-out ShareGPT conversations"
    )
    parser.add_argument("--turns", type=int, default=4, help="user turns of each conversation")
    parser.add_argument(
        "--llama-server", action="store_true", help="a llama-server session in each round too"
    )
    parser.add_argument("--dram-budget", help="Lever's (default: the real pair's, 25%%)")
    parser.add_argument("--memory-limit", help="e.g. 1GiB")
    parser.add_argument(
        "--ctx-size", type=int, help="Lever's context (default: its own; auto's room is 4,096)"
    )
    parser.add_argument(
        "--out", type=Path, help="default: results/conversation-LIMIT.json, or -nolimit"
    )
    args = parser.parse_args()
    limit = parse_bytes(args.memory_limit) if args.memory_limit else None
    name = "".join(args.memory_limit.split()) if args.memory_limit else "nolimit"
    out = args.out or RESULTS / f"conversation-{name}.json"
    chosen = list(
        islice(sharegpt_conversations(default_cache_dir(), args.turns), args.conversations)
    )
    if len(chosen) < args.conversations:
        raise SystemExit(f"only {len(chosen)} held-out conversations of {args.turns} turns")
    conversations = [list(c.turns[: args.turns]) for c in chosen]
    cgroup = None
    if limit:
        cgroup = MemoryCgroup(probe_cgroup(), f"lever-chat-{os.getpid()}", limit)
    budget = ["--dram-budget", args.dram_budget] if args.dram_budget else []
    budget += ["--ctx-size", str(args.ctx_size)] if args.ctx_size else []
    sessions = {
        "prompt_cache": lever_server(*budget),
        "no_prompt_cache": lever_server(*budget, "--prompt-cache", "0"),
    }
    if args.llama_server:
        sessions["llama_server"] = llama_server()
    runs = []
    try:
        for _ in range(args.repeats):
            runs.append(
                {
                    server: session(argv, conversations, args.tokens, cgroup)
                    for server, argv in sessions.items()
                }
            )
            for server, run in runs[-1].items():
                report(server, run)
    finally:
        if cgroup is not None:
            cgroup.remove()
    figures = summary(runs)
    print(json.dumps(figures))
    record = {
        "machine": msgspec.to_builtins(Machine.here()),
        "tokens": args.tokens,
        "dram_budget": args.dram_budget or "25%",
        "ctx_size": args.ctx_size,
        "memory_limit_bytes": limit,
        "conversations": [
            {"item": c.item, "id": c.id, "turns": turns}
            for c, turns in zip(chosen, conversations, strict=True)
        ],
    }
    out.write_text(json.dumps(record | {"summary": figures, "runs": runs}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
