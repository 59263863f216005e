"""A long prompt resumed after a restart, on the real pair: `generate` on a prompt of about N
tokens with `--prompt-cache-dir` empty (a cold prefill; the engine writes the prompt's KV
there as it exits), then a second process on the same prompt and directory, which reads
the KV back instead of prefilling. Reports each one's wait for its first token and the
tokens it took from the directory, and checks that both write the same text. The weight
files and the directory are evicted from the page cache before each run, and with
--memory-limit each runs in a cgroup of that limit.

    .venv/bin/python benchmarks/resume.py [--tokens 1400,2000] [--budget 25%] [--repeats 2]
        [--new-tokens 16] [--memory-limit 1GiB] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from statistics import median

import msgspec
from long_prompt import CLI, completed, prompt_of, real_pair_runs

from lever_actors.bench.results import Machine
from lever_actors.sizes import parse_bytes


def lever(text: str, budget: str, new: int, directory: Path, cgroup, evict) -> dict:
    argv = [*CLI, "generate", "--prompt", text, "--max-new-tokens", str(new), "--stats", "json"]
    argv += ["--dram-budget", budget, "--prompt-cache-dir", str(directory)]
    done = completed(argv, cgroup, [*evict, directory])
    stats = json.loads(done.stderr.splitlines()[-1])
    return {
        "prompt_tokens": stats["prompt_tokens"],
        "cached_tokens": stats["cached_tokens"],
        "first_token_s": stats["first_token_seconds"],
        "load_s": stats["load_seconds"],
        "text": done.stdout,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1400,2000", help="prompt sizes, comma-separated")
    parser.add_argument("--budget", default="25%", help="Lever's --dram-budget")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--memory-limit", type=parse_bytes)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    _, evict, cgroup, tokenizer = real_pair_runs("lever-resume", args.memory_limit)
    rows = []
    try:
        for size in (int(n) for n in args.tokens.split(",")):
            text = prompt_of(tokenizer, size)
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory(prefix="lever-resume-") as directory:
                    where = Path(directory)
                    cold = lever(text, args.budget, args.new_tokens, where, cgroup, evict)
                    resumed = lever(text, args.budget, args.new_tokens, where, cgroup, evict)
                if resumed["text"] != cold["text"]:
                    raise SystemExit(f"{size} tokens: the resumed run wrote another text")
                rows.append({"tokens": size, "cold": cold, "resumed": resumed})
                ratio = resumed["first_token_s"] / cold["first_token_s"]
                cold_s, resumed_s = cold["first_token_s"], resumed["first_token_s"]
                print(
                    f"{cold['prompt_tokens']} prompt tokens: first token {cold_s:.2f} s cold,"
                    f" {resumed_s:.2f} s resumed ({ratio:.3f}x, {resumed['cached_tokens']} cached)",
                    flush=True,
                )
    finally:
        if cgroup is not None:
            cgroup.remove()
    ratios = [r["resumed"]["first_token_s"] / r["cold"]["first_token_s"] for r in rows]
    summary = {"resumed_ttft_over_cold": median(ratios), "same_tokens": True}
    print(json.dumps(summary))
    if args.out:
        record = {
            "machine": msgspec.to_builtins(Machine.here()),
            "command": " ".join(["benchmarks/resume.py", *sys.argv[1:]]),
            "memory_limit_bytes": args.memory_limit,
            "budget": args.budget,
            "new_tokens": args.new_tokens,
            "summary": summary,
            "runs": rows,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
