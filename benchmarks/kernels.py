"""Milliseconds per call of our quantized kernels (model/native.py: AMX or AVX2, whichever this
CPU has) against torch's weight-only kernels, on the real target's matrix shapes, random
weights, DRAM-cold (copies enough to overflow the caches are cycled), by rows per call.
torch has no kernel for the k-quants: q6k's rows are against our int8 kernel, q4k's against our
int4 kernel, on the same values.

    .venv/bin/python benchmarks/kernels.py [--rows 1,8,64] [--seconds 0.5]
"""

from __future__ import annotations

import argparse
import time

import torch

from lever_actors.checkpoints.quantize import quantize_q4k, quantize_q6k
from lever_actors.model import native
from lever_actors.model.formats import GROUP
from lever_actors.model.quantized import (
    QuantizedWeight,
    quantize_int4,
    quantize_int8,
    torch_packing,
)

SHAPES = [  # (format, [out, in]) of the real target's matrices and LM head
    ("int4", (8960, 1536)),
    ("int4", (1536, 8960)),
    ("int8", (1536, 8960)),
    ("int8", (8192, 1536)),  # a part of the LM head as it streams
    ("q6k", (1536, 8960)),
    ("q6k", (8192, 1536)),
    ("q4k", (8960, 1536)),
    ("q4k", (1536, 8960)),
]
QUANTIZE = {
    "int4": quantize_int4,
    "int8": quantize_int8,
    "q6k": quantize_q6k,
    "q4k": quantize_q4k,
}
KERNELS = {
    "int4": native.int4_linear,
    "int8": native.int8_linear,
    "q6k": native.q6k_linear,
    "q4k": native.q4k_linear,
}
OURS_AGAINST = {"q6k": "int8", "q4k": "int4"}  # no torch kernel: against ours on the same values
COLD_BYTES = 200_000_000  # more than any last-level cache here


def copies(weight: QuantizedWeight) -> list[QuantizedWeight]:
    count = max(1, COLD_BYTES // weight.nbytes)
    return [
        QuantizedWeight(weight.fmt, weight.shape, weight.data.clone(), weight.scales.clone())
        for _ in range(count)
    ]


def ours(weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    return KERNELS[weight.fmt](x, weight.data, weight.scales)


def torchs(weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    if weight.fmt == "int4":  # in torch's own packing, repacked before the clock starts
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, torch_packing(weight), GROUP, weight.scales
        )
    return torch.ops.aten._weight_int8pack_mm(x, weight.data, weight.scales)


def milliseconds(kernel, weights: list[QuantizedWeight], x: torch.Tensor, seconds: float) -> float:
    for weight in weights:  # warm-up; int4 repacks for torch's kernel here
        kernel(weight, x)
    started, calls = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        kernel(weights[calls % len(weights)], x)
        calls += 1
    return (time.perf_counter() - started) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,64", help="rows per call, comma-separated")
    parser.add_argument("--seconds", type=float, default=0.5, help="timed per cell")
    args = parser.parse_args()
    isa = native.loaded()
    if isa is None:
        raise SystemExit("our kernels do not load on this machine (see the log above)")
    rows = [int(r) for r in args.rows.split(",")]
    threads = torch.get_num_threads()
    baselines = "; ".join(f"{fmt}: / our {other}" for fmt, other in OURS_AGAINST.items())
    print(f"ms per call, ours ({isa.name}) / torch's ({baselines}), {threads} threads")
    print("| matrix | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    generator = torch.Generator().manual_seed(0)
    for fmt, shape in SHAPES:
        values = torch.randn(shape, generator=generator) * 0.02
        weights = copies(QUANTIZE[fmt](values))
        if fmt in OURS_AGAINST:
            against, other = ours, copies(QUANTIZE[OURS_AGAINST[fmt]](values))
        else:
            against, other = torchs, weights
        cells = []
        for n in rows:
            x = torch.randn(n, shape[1], generator=generator).to(torch.bfloat16)
            mine = milliseconds(ours, weights, x, args.seconds)
            theirs = milliseconds(against, other, x, args.seconds)
            cells.append(f"{mine:.2f} / {theirs:.2f}")
        print(f"| {fmt} {shape[0]}x{shape[1]} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
