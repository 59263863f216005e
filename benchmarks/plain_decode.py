"""The plain path's decode against torch's on the real target (issue #63): the whole target
resident, the same weights in the same memory, greedy one-token decoding after a prompt,
torch's model (our fused layer, one torch op a layer) and the plain model (one C call a
layer, no torch tensor) taking turns. Reports each one's prefill and decode tok/s and
whether their tokens agree (they must: the kernels and roundings are the same).

    .venv/bin/python benchmarks/plain_decode.py [--prompt-tokens 200] [--tokens 64] [--runs 3]
                                                [--out benchmarks/results/plain-decode.json]

Both paths run in this one process, each with its own OpenMP team (torch's and the plain
library's), so its timings are rough: benchmarks/native_start.py times the two apart. Run it
on a quiet machine: both paths use every core."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import msgspec

from lever_actors.bench.results import Machine
from lever_actors.checkpoints.real_pair import real_pair
from lever_actors.device.budget import plan_residency
from lever_actors.device.manifest import read_manifest
from lever_actors.model import plain_from_torch, plain_model
from lever_actors.model.sequential import sequential_stream
from lever_actors.model.transformer import Transformer
from lever_actors.model.weights import ModelWeights
from lever_actors.target import FlashTarget

PROMPT = (
    "Write a Python function that parses a CSV file of orders, groups them by customer, and "
    "returns the three customers who spent the most, with a docstring and type hints. "
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--paths", default="torch,plain", help="which paths to run, in turn (default: both)"
    )
    args = parser.parse_args()
    layout = Path(real_pair().target)
    manifest = read_manifest(layout)
    target = FlashTarget(layout, plan_residency(manifest, manifest.file_bytes))
    assert target.tokenizer is not None and target.lm_head is not None
    weights = ModelWeights(
        target.embed_table,
        target.final_norm,
        target.lm_head,
        [target.resident_layers[i] for i in range(target.args.n_layers)],
    )
    theirs = Transformer(target.args, weights)
    ours = plain_model.Model(
        target.args,
        plain_from_torch.weights(
            weights.embed, weights.layers, weights.final_norm, weights.lm_head
        ),
    )
    ids = target.tokenizer.encode(PROMPT * 20)[: args.prompt_tokens]
    paths = args.paths.split(",")
    runs: dict[str, list[dict]] = {name: [] for name in paths}
    for run in range(args.runs):
        for name, decode in (("torch", torch_decode), ("plain", plain_decode)):
            if name not in paths:
                continue
            model = theirs if name == "torch" else ours
            runs[name].append(decode(model, ids, args.tokens))  # type: ignore[operator]
            print(f"run {run + 1} {name}: {summary(runs[name][-1])}", file=sys.stderr)
    first = next(iter(runs.values()))[0]["tokens"]
    agree = all(r["tokens"] == first for rs in runs.values() for r in rs)
    result = {
        "machine": msgspec.to_builtins(Machine.here()),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["benchmarks/plain_decode.py", *sys.argv[1:]]),
        "prompt_tokens": len(ids),
        "new_tokens": args.tokens,
        "tokens_agree": agree,
        **{
            name: {
                "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in rs),
                "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
            }
            for name, rs in runs.items()
        },
    }
    if len(runs) == 2:
        result["decode_plain_over_torch"] = round(
            result["plain"]["decode_tok_s"] / result["torch"]["decode_tok_s"], 3
        )
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0 if agree else 1


def torch_decode(model: Transformer, ids: list[int], new: int) -> dict:
    stream = sequential_stream(model, ids, new)
    started = time.perf_counter()
    first = next(stream)
    prefilled = time.perf_counter()
    tokens = [first, *stream]
    return timed(tokens, len(ids), started, prefilled, time.perf_counter())


def plain_decode(model: plain_model.Model, ids: list[int], new: int) -> dict:
    stream = plain_model.token_stream(model, ids, new)
    started = time.perf_counter()
    first = next(stream)
    prefilled = time.perf_counter()
    tokens = [first, *stream]
    return timed(tokens, len(ids), started, prefilled, time.perf_counter())


def timed(tokens: list[int], prompt: int, started: float, prefilled: float, ended: float) -> dict:
    return {
        "tokens": tokens,
        "prefill_tok_s": round(prompt / (prefilled - started), 2),
        "decode_tok_s": round((len(tokens) - 1) / (ended - prefilled), 2),
    }


def summary(run: dict) -> str:
    return f"prefill {run['prefill_tok_s']} tok/s, decode {run['decode_tok_s']} tok/s"


if __name__ == "__main__":
    raise SystemExit(main())
