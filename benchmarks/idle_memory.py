"""An idle engine's resident memory by part, on the real pair (issue #48, part 3): RssAnon
(what a memory limit cannot reclaim: heap, weights read) and RssFile (pages of libraries
and mapped files, which a limit can drop and page in again), read from /proc/self/status
after each stage of one start:

1. interpreter: this script's first lines, before anything else is imported;
2. torch: `import torch`;
3. lever_actors: the engine's modules imported, with the real pair's helpers (as
   `lever-actors generate` imports them);
4. engine: an Engine open on the real pair (found, or fetched and converted once, as
   `lever-actors generate` does), before its first request.

Each stage adds to the ones before it, so each run is a process of its own: run the
script, never import it into a process that has loaded torch (it refuses).

    .venv/bin/python benchmarks/idle_memory.py [--dram-budget auto] [--plan auto|trees|lookup|ar]
                                          [--out FILE.json]
"""

from __future__ import annotations

import sys

FIELDS = ("RssAnon", "RssFile", "RssShmem", "VmRSS", "VmHWM")


def status_fields(text: str, names: tuple[str, ...] = FIELDS) -> dict[str, int]:
    """The `names` of a /proc/PID/status text ("RssAnon:   123456 kB" lines), in bytes;
    a field the text does not hold, or holds in another form, is left out."""
    out = {}
    for line in text.splitlines():
        name, colon, rest = line.partition(":")
        parts = rest.split()
        if colon and name in names and len(parts) == 2 and parts[1] == "kB":
            if parts[0].isdigit():
                out[name] = int(parts[0]) * 1024
    return out


def sample() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return status_fields(f.read())


STARTED = sample()  # stage 1, before any import of this script's other modules

import argparse  # noqa: E402  (after the interpreter's own reading)
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def stage(name: str, fields: dict[str, int], seconds: float) -> dict[str, object]:
    return {
        "stage": name,
        "seconds": round(seconds, 3),
        "anon_mib": round(fields.get("RssAnon", 0) / 2**20, 1),
        "file_mib": round(fields.get("RssFile", 0) / 2**20, 1),
        "bytes": fields,
    }


def show(stages: list[dict]) -> None:
    print(f"{'stage':<14} {'anon MiB':>9} {'file MiB':>9} {'+anon':>8} {'+file':>8}")
    before = {"anon_mib": 0.0, "file_mib": 0.0}
    for s in stages:
        grown = [s[k] - before[k] for k in ("anon_mib", "file_mib")]
        print(
            f"{s['stage']:<14} {s['anon_mib']:>9.1f} {s['file_mib']:>9.1f} "
            f"{grown[0]:>+8.1f} {grown[1]:>+8.1f}"
        )
        before = s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dram-budget", default="auto", help="the engine's (default: auto)")
    parser.add_argument(
        "--plan",
        choices=("auto", "trees", "lookup", "ar"),
        default=None,
        help="the engine's decode plan (default: none, the draft and tree as configured)",
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help="the models' cache")
    parser.add_argument("--out", type=Path, default=RESULTS / "idle-memory.json")
    args = parser.parse_args()
    if "torch" in sys.modules or "lever_actors" in sys.modules:
        raise SystemExit("idle_memory.py measures a fresh process: run it, do not import it")
    stages = [stage("interpreter", STARTED, 0.0)]

    t0 = time.perf_counter()
    import torch  # noqa: F401  (its import is the stage measured)

    stages.append(stage("torch", sample(), time.perf_counter() - t0))

    t0 = time.perf_counter()
    import msgspec
    import trio

    from lever_actors.checkpoints.real_pair import real_model_path, real_target_layout
    from lever_actors.config import EngineConfig
    from lever_actors.engine import Engine
    from lever_actors.paths import default_cache_dir
    from lever_actors.progress import ProgressLine

    stages.append(stage("lever_actors", sample(), time.perf_counter() - t0))

    cache = args.cache_dir or default_cache_dir()
    target = real_target_layout(cache, ProgressLine())
    draft = real_model_path(cache, "draft", ProgressLine())
    config = EngineConfig(
        target=str(target), draft=str(draft), dram_budget=args.dram_budget, plan=args.plan
    )

    async def idle_engine() -> dict[str, object]:
        t0 = time.perf_counter()
        async with Engine.open(config) as engine:
            stages.append(stage("engine", sample(), time.perf_counter() - t0))
            return {
                "memory": msgspec.to_builtins(engine.plan.memory),
                "memory_line": str(engine.plan.memory),
                "plan_line": str(engine.plan.decode),
                "decode_plan": msgspec.to_builtins(engine.plan.decode),
            }

    opened = trio.run(idle_engine)
    show(stages)
    print(opened["memory_line"])
    print(opened["plan_line"])
    from lever_actors.bench.results import Machine  # after the stages: not counted

    record = {
        "command": " ".join(["benchmarks/idle_memory.py", *sys.argv[1:]]),
        "machine": msgspec.to_builtins(Machine.here()),
        "config": {
            "target": str(target),
            "draft": str(draft),
            "dram_budget": args.dram_budget,
            "plan": args.plan,
        },
        "stages": stages,
        **opened,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"results: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
