"""Long prompts on the real pair: Lever's prefill (the prompt over the wait for its first
token, `generate --stats json`) against llama.cpp's prompt eval (`llama-completion` on the
target's GGUF, 2 threads), each run a process of its own, alternating. The prompt is the
opening of the standard library's argparse.py, cut to about N tokens of the target's
tokenizer. With --memory-limit each run is in a cgroup of that limit, the weight files
evicted from the page cache before it. The summary: per size and budget, Lever's median
prefill tok/s over llama.cpp's.

    .venv/bin/python benchmarks/long_prompt.py [--tokens 1400,2000] [--budgets 25%,all]
        [--repeats 2] [--new-tokens 32] [--memory-limit 1GiB] [--ctx-size N] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

import gguf
import msgspec

from lever_actors.bench.isolation import MemoryCgroup, evict_from_page_cache, probe_cgroup
from lever_actors.bench.llamacpp_build import COMPLETION, find_build
from lever_actors.bench.llamacpp_output import parse_completion_timings
from lever_actors.bench.results import Machine
from lever_actors.checkpoints.real_pair import real_model_path, real_target_layout
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.paths import default_cache_dir
from lever_actors.sizes import parse_bytes

CLI = [sys.executable, "-c", "from lever_actors.launch import console; console()"]
SOURCE = Path(sys.base_prefix, "lib", "python3.11", "argparse.py")  # held out from the sets


def prompt_of(tokenizer: Tokenizer, tokens: int) -> str:
    """The source's first lines, as many as make about `tokens` tokens."""
    text = ""
    for line in SOURCE.read_text().splitlines(keepends=True):
        if len(tokenizer.encode(text + line)) > tokens:
            break
        text += line
    return text


def real_pair_runs(
    name: str, memory_limit: int | None
) -> tuple[Path, list[Path], MemoryCgroup | None, Tokenizer]:
    """The target's GGUF, the real pair's files to evict before each run, a cgroup named
    after `name` of `memory_limit` (None: no cgroup), and the target's tokenizer."""
    cache = default_cache_dir()
    target = real_model_path(cache, "target")
    evict = [target, real_model_path(cache, "draft"), real_target_layout(cache)]
    cgroup = None
    if memory_limit:
        cgroup = MemoryCgroup(probe_cgroup(), f"{name}-{os.getpid()}", memory_limit)
    return target, evict, cgroup, Tokenizer.from_gguf(gguf.GGUFReader(str(target)), target)


def run(argv: list[str], cgroup: MemoryCgroup | None, evict: list[Path]) -> str:
    """Its stderr; under `cgroup` from its first instruction (it joins before exec)."""
    return completed(argv, cgroup, evict).stderr


def completed(
    argv: list[str], cgroup: MemoryCgroup | None, evict: list[Path]
) -> subprocess.CompletedProcess[str]:
    """`argv` run to its end, its output captured, the `evict` files out of the page cache
    before it starts; a failure raises with its last line."""
    evict_from_page_cache(evict)
    joined = (lambda: cgroup.add(os.getpid())) if cgroup else None
    done = subprocess.run(
        argv, capture_output=True, text=True, preexec_fn=joined, stdin=subprocess.DEVNULL
    )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["nothing on stderr"]
        raise RuntimeError(f"{Path(argv[0]).name} exited {done.returncode}: {tail[0]}")
    return done


def lever(text: str, budget: str, new: int, ctx: list[str], cgroup, evict) -> dict:
    argv = [*CLI, "generate", "--prompt", text, "--max-new-tokens", str(new), *ctx]
    stats = json.loads(
        run([*argv, "--dram-budget", budget, "--stats", "json"], cgroup, evict).splitlines()[-1]
    )
    return {
        "prompt_tokens": stats["prompt_tokens"],
        "prefill_tok_s": stats["prefill_tokens_per_second"],
        "first_token_s": stats["first_token_seconds"],
        "decode_tok_s": stats["decode_tokens_per_second"],
    }


def llamacpp(program: Path, text: str, new: int, cgroup, evict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as prompt:
        prompt.write(text)
        prompt.flush()
        argv = [str(program), "-m", str(evict[0]), "-f", prompt.name, "-n", str(new)]
        argv += ["-c", "8192", "-t", "2", "--temp", "0", "-no-cnv", "--no-display-prompt"]
        timings = parse_completion_timings(run(argv, cgroup, evict))
    assert timings.prompt_tokens is not None and timings.prefill_s  # it always prints them
    return {
        "prompt_tokens": timings.prompt_tokens,
        "prefill_tok_s": timings.prompt_tokens / timings.prefill_s,
        "decode_tok_s": timings.decode_tok_s,
    }


def summary(rows: list[dict]) -> dict:
    """`prefill_vs_llamacpp`: per prompt size (as asked for), per Lever budget, the median
    prefill tok/s over llama.cpp's median."""
    ratios: dict[str, dict[str, float]] = {}
    for size in dict.fromkeys(row["tokens"] for row in rows):
        runs = [row for row in rows if row["tokens"] == size]
        theirs = median(row["llamacpp"]["prefill_tok_s"] for row in runs)
        ratios[str(size)] = {
            key.removeprefix("lever_"): median(row[key]["prefill_tok_s"] for row in runs) / theirs
            for key in runs[0]
            if key.startswith("lever_")
        }
    return {"prefill_vs_llamacpp": ratios}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1400,2000", help="prompt sizes, comma-separated")
    parser.add_argument("--budgets", default="25%,all", help="Lever's --dram-budget values")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--memory-limit", type=parse_bytes)
    parser.add_argument(
        "--ctx-size", type=int, help="Lever's context (default: its own; auto's room is 4,096)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    build = find_build(default_cache_dir())
    if build is None:
        raise SystemExit("no llama.cpp build: run `lever-actors build-llamacpp` first")
    target, evict, cgroup, tokenizer = real_pair_runs("lever-long-prompt", args.memory_limit)
    ctx = ["--ctx-size", str(args.ctx_size)] if args.ctx_size else []
    rows = []
    try:
        for size in (int(n) for n in args.tokens.split(",")):
            text = prompt_of(tokenizer, size)
            for _ in range(args.repeats):  # alternating, so that drift hits all alike
                row = {
                    "tokens": size,
                    "llamacpp": llamacpp(
                        build.program(COMPLETION), text, args.new_tokens, cgroup, evict
                    ),
                }
                for budget in args.budgets.split(","):
                    row[f"lever_{budget}"] = lever(
                        text, budget, args.new_tokens, ctx, cgroup, evict
                    )
                rows.append(row)
                print(
                    json.dumps(
                        {
                            k: v if k == "tokens" else round(v["prefill_tok_s"], 1)
                            for k, v in row.items()
                        }
                    ),
                    flush=True,
                )
    finally:
        if cgroup is not None:
            cgroup.remove()
    figures = summary(rows)
    print(json.dumps(figures))
    if args.out:
        record = {
            "machine": msgspec.to_builtins(Machine.here()),
            "memory_limit_bytes": args.memory_limit,
            "new_tokens": args.new_tokens,
            "ctx_size": args.ctx_size,
            "summary": figures,
            "runs": rows,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
