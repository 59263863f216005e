"""The native path's start (issue #63): `generate --plan ar` on the real target from launch
to its first token and to exit, on the plain kernels without torch (`plain`), on torch's
engine (`torch`: the same flags with `--dram-budget all`, which the plain path leaves to
the engine; the whole target resident either way) and `llama-completion` on the same GGUF,
each in its own cgroup of --limit with a warm page cache, the modes taking turns.

    .venv/bin/python benchmarks/native_start.py [--limit 3GiB] [--runs 5] [--tokens 4,64]
        [--smallest 1.25GiB,1.2GiB,1.15GiB,1.1GiB] [--out benchmarks/results/native.json]

Reported per token count and mode: the median launch to first token (its first byte on
stdout; llama-completion with --no-display-prompt) and to exit, peak RSS, our decode tok/s
and the `memory:` line's parts (process, libraries); then, per limit of --smallest, whether
one-token decoding keeps every layer and the LM head in DRAM there (and the embedding
table, or its rows read from flash): on the plain path (taken), and on the engine under its
automatic budget (0 layers streamed; `--trace /dev/null` sends it there). Run it on a quiet
machine."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec

from lever_actors.bench.isolation import MemoryCgroup, probe_cgroup
from lever_actors.bench.results import Machine
from lever_actors.checkpoints.fetch import REAL_MODELS
from lever_actors.paths import default_cache_dir
from lever_actors.sizes import parse_bytes

RESULTS = Path(__file__).parent / "results"
PROMPT = "def fibonacci(n):"
RUN_SECONDS = 300


class Run(msgspec.Struct):
    first_s: float | None  # launch to the first byte of stdout
    exit_s: float
    peak_rss_bytes: int
    status: int
    output: str  # stderr's tail


def launch(argv: list[str], limit: str) -> Run:
    """`argv` in a new cgroup of `limit`: when its stdout's first byte came, when it
    exited, its peak RSS."""
    cgroup = MemoryCgroup(probe_cgroup(), f"lever-native-{os.getpid()}", parse_bytes(limit))
    try:
        started = time.perf_counter()
        child = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=lambda: cgroup.add(os.getpid()),
        )
        first: list[float] = []
        err: list[bytes] = []
        drain = threading.Thread(target=lambda: err.append(child.stderr.read()))  # type: ignore[union-attr]
        drain.start()
        assert child.stdout is not None
        if child.stdout.read(1):
            first.append(time.perf_counter() - started)
        child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
        ended = time.perf_counter() - started
        drain.join(timeout=RUN_SECONDS)
        child.returncode = os.waitstatus_to_exitcode(status)
        text = b"".join(err).decode(errors="replace")
        return Run(
            first[0] if first else None,
            ended,
            usage.ru_maxrss * 1024,
            child.returncode,
            text[-3000:],
        )
    finally:
        cgroup.remove()


def figure(pattern: str, text: str) -> float | None:
    found = re.search(pattern, text)
    return float(found.group(1).replace(",", "")) if found else None


def mib(pattern: str, text: str) -> float | None:
    """A `memory:` line's part in MiB (it prints MiB or GiB)."""
    found = re.search(pattern + r" ([\d.,]+) (KiB|MiB|GiB)", text)
    if not found:
        return None
    scale = {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}[found.group(2)]
    return round(float(found.group(1).replace(",", "")) * scale, 1)


def commands(tokens: int) -> dict[str, list[str]]:
    lever = str(Path(sys.executable).parent / "lever-actors")
    ours = [lever, "generate", "--plan", "ar", "--prompt", PROMPT, "--max-new-tokens", str(tokens)]
    gguf = default_cache_dir() / REAL_MODELS["target"].file_name
    llama = default_cache_dir() / "llama.cpp" / "bin" / "llama-completion"
    return {
        "plain": ours,
        "torch": [*ours, "--dram-budget", "all"],
        "llama_completion": [
            str(llama), "-m", str(gguf), "-p", PROMPT, "-n", str(tokens), "-t", "2",
            "--temp", "0", "-no-cnv", "--no-display-prompt",
        ],
    }  # fmt: skip


def summary(runs: list[Run]) -> dict:
    ok = [r for r in runs if r.status == 0]
    last = runs[-1].output
    firsts = [r.first_s for r in ok if r.first_s is not None]
    return {
        "runs": len(runs),
        "failed": len(runs) - len(ok),
        "first_token_s": round(statistics.median(firsts), 3) if firsts else None,
        "exit_s": round(statistics.median(r.exit_s for r in ok), 3) if ok else None,
        "exit_s_all": [round(r.exit_s, 3) for r in runs],
        "peak_rss_mib": round(max(r.peak_rss_bytes for r in runs) / 2**20, 1),
        "decode_tok_s": _median(figure(r"decode ([\d.]+) tok/s", r.output) for r in ok),
        "process_mib": mib(r"process", last),
        "libraries_mib": mib(r"libraries", last),
    }


def _median(values) -> float | None:
    found = [v for v in values if v is not None]
    return round(statistics.median(found), 2) if found else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", default="3GiB")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", default="4,64")
    parser.add_argument("--smallest", default="1.25GiB,1.2GiB,1.15GiB,1.1GiB")
    parser.add_argument("--out", type=Path, default=RESULTS / "native.json")
    args = parser.parse_args()
    if not probe_cgroup().usable:
        raise SystemExit(f"no usable memory cgroup: {probe_cgroup().describe()}")
    for argv in commands(4).values():  # warm the page cache and every build once
        launch(argv, args.limit)
    counts: dict[str, dict] = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        runs: dict[str, list[Run]] = {name: [] for name in commands(tokens)}
        for _ in range(args.runs):
            for name, argv in commands(tokens).items():
                runs[name].append(launch(argv, args.limit))
        counts[str(tokens)] = {name: summary(rs) for name, rs in runs.items()}
        mine, theirs = counts[str(tokens)]["plain"], counts[str(tokens)]["llama_completion"]
        if mine["exit_s"] and theirs["exit_s"]:
            counts[str(tokens)]["plain_exit_over_llama"] = round(
                mine["exit_s"] / theirs["exit_s"], 3
            )
        print(json.dumps({tokens: counts[str(tokens)]}, indent=1), file=sys.stderr)
    smallest = {}
    ours = commands(1)["plain"]
    for limit in args.smallest.split(","):
        plain, torch = launch(ours, limit), launch([*ours, "--trace", "/dev/null"], limit)
        smallest[limit] = {  # every layer and the LM head in DRAM (the table's rows may stream)
            "plain_layers_resident": plain.status == 0
            and "plan: ar on the plain kernels" in plain.output,
            "plain_table_resident": "rows read from flash" not in plain.output,
            "torch_layers_resident": torch.status == 0
            and " 0/28 target layers streamed" in torch.output,
            "plain_tail": plain.output[-400:],
            "torch_tail": torch.output[-400:],
        }
        verdict = {k: v for k, v in smallest[limit].items() if not k.endswith("tail")}
        print(limit, verdict, file=sys.stderr)
    record = {
        "command": " ".join(["benchmarks/native_start.py", *sys.argv[1:]]),
        "machine": msgspec.to_builtins(Machine.here()),
        "date": time.strftime("%Y-%m-%d"),
        "limit": args.limit,
        "prompt": PROMPT,
        "tokens": counts,
        "layers_resident_at": smallest,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"results: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
