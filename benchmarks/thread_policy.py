"""Decode tok/s of memory-resident AR and Lever under thread settings, on a quiet machine and
beside one busy neighbour process, all in one run (each generation a process of its own).

    .venv/bin/python benchmarks/thread_policy.py [--tokens 32] [--repeats 2] [--baseline-tree DIR]

Settings: ours (the CLI's default, lever_actors/launch.py), torch's default (the wait
policy left unset: idle threads spin a while, then sleep), idle threads sleeping at once
(OMP_WAIT_POLICY=PASSIVE) and one thread (OMP_NUM_THREADS=1).
--baseline-tree adds the code of another checkout (e.g. a worktree of an older commit) with
idle threads sleeping as in ours, to price a change of code. Results: a markdown table on
stdout and a JSON file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Write a Python function that checks whether a string is a palindrome."
# name -> (entry module, environment); the CLI's entry point sets the wait policy, cli's does not
SETTINGS = {
    "ours": ("lever_actors.launch", {}),
    "torch's default (wait policy unset)": ("lever_actors.cli", {}),
    "idle threads sleep (OMP_WAIT_POLICY=PASSIVE)": (
        "lever_actors.cli",
        {"OMP_WAIT_POLICY": "PASSIVE"},
    ),
    "one thread (OMP_NUM_THREADS=1)": ("lever_actors.launch", {"OMP_NUM_THREADS": "1"}),
}
RATE = re.compile(r"decode ([0-9.]+) tok/s")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def workloads(layout: Path, tokens: int) -> dict[str, list[str]]:
    """Arguments after the chat flag and PROMPT (see `chat_flag`)."""
    common = ["generate", "--max-new-tokens", str(tokens)]
    return {
        "memory-ar": [*common, "--model", str(layout), "--dtype", "bfloat16"],
        "lever@25%": common,
    }


def chat_flag(tree: Path) -> str:
    """The flag that sends PROMPT through the chat template in the checkout `tree`: --chat
    since the CLI took raw text on --prompt, --prompt before."""
    return "--chat" if (tree / "lever_actors/cli/generate.py").is_file() else "--prompt"


def decode_rate(tree: Path, entry: str, args: list[str], env_extra: dict[str, str]) -> float:
    """Run `lever-actors ARGS` from the checkout `tree` through `entry`; -> its decode tok/s."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env |= env_extra | {"PYTHONPATH": str(tree)}
    code = f"import sys; from {entry} import main; sys.exit(main())"
    args = [*args, chat_flag(tree), PROMPT]
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True
    )
    return float(RATE.findall(done.stderr)[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="runs per cell; the median counts")
    parser.add_argument("--baseline-tree", type=Path, default=None)
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME:VAR=VALUE[,VAR=VALUE]",
        help="another setting to compare, through torch's defaults plus these variables",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/thread-policy.json")
    parser.add_argument(
        "--layout",
        type=Path,
        default=Path.home() / ".cache/lever_actors/flash/qwen2.5-coder-1.5b-instruct-q4_k_m-bf16",
    )
    args = parser.parse_args()
    variants = {name: (REPO, entry, env) for name, (entry, env) in SETTINGS.items()}
    if args.baseline_tree:
        # the same wait policy as ours, so that the difference is the code's
        variants[f"baseline ({args.baseline_tree.name})"] = (
            args.baseline_tree,
            "lever_actors.cli",
            {"OMP_WAIT_POLICY": "PASSIVE"},
        )
    for setting in args.setting:
        name, _, assignments = setting.partition(":")
        env = dict(item.split("=", 1) for item in assignments.split(","))
        variants[name] = (REPO, "lever_actors.cli", env)
    rows = []
    for condition in ("quiet", "busy neighbour"):
        neighbour = None
        if condition == "busy neighbour":
            neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(1)
        try:
            for repeat in range(args.repeats):  # settings take turns: drift hits all alike
                for workload, command in workloads(args.layout, args.tokens).items():
                    for name, (tree, entry, env) in variants.items():
                        rate = decode_rate(tree, entry, command, env)
                        cell = {"condition": condition, "workload": workload, "setting": name}
                        rows.append(cell | {"repeat": repeat, "decode_tok_s": rate})
                        print(
                            f"{condition:15} {workload:10} {name:34} {rate:6.2f} tok/s",
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            if neighbour:
                neighbour.kill()
    result = {
        "command": " ".join([".venv/bin/python", "benchmarks/thread_policy.py", *sys.argv[1:]]),
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"Measured {result['date']} on {result['cpu']} ({result['cores']} cores), "
        f"{args.tokens} tokens, median decode tok/s of {args.repeats} runs:\n"
    )
    print("| condition | workload | " + " | ".join(variants) + " | ours / best |")
    print("|---|---|" + "---|" * (len(variants) + 1))
    for condition in ("quiet", "busy neighbour"):
        for workload in workloads(args.layout, args.tokens):
            rates = {
                name: statistics.median(
                    r["decode_tok_s"]
                    for r in rows
                    if (r["condition"], r["workload"], r["setting"]) == (condition, workload, name)
                )
                for name in variants
            }
            best = max(rates[name] for name in SETTINGS)
            cells = " | ".join(f"{rates[name]:.2f}" for name in variants)
            print(f"| {condition} | {workload} | {cells} | {rates['ours'] / best:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
