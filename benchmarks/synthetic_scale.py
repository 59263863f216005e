"""Scale on a real model's shape (issue #63): a GGUF of Qwen2.5-7B's shape with random
weights, quantized as Q4_K_M files are (Q4_K, with Q6_K for half the layers' attn_v and
ffn_down and for the LM head), its tokenizer the real target's. Random weights measure
speed only, never acceptance: the plan is `ar`.

    .venv/bin/python benchmarks/synthetic_scale.py [--limits 2GiB,3GiB,4GiB] [--tokens 16]
                                                   [--out benchmarks/results/synthetic-7b.json]

Writes the GGUF once into the cache (4.9 GB), then per limit, in a cgroup of that limit
with the file and our layout of it evicted from the page cache: `lever-actors generate
--target the.gguf --plan ar` (its first run converts the GGUF into our layout, outside the
limit) and `llama-completion` on the same file. Reported per limit: our load time against
the time to read and check the resident bytes at the disk's O_DIRECT bandwidth (measured
in the same run, median of 3) and against the time a fresh process takes to fault in as
many bytes of new memory on one thread, launch to exit of both, and decode tok/s
with the share of the disk's bandwidth our streamed reads reach."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import gguf
import msgspec
import numpy as np

from lever_actors.bench.isolation import MemoryCgroup, evict_from_page_cache, probe_cgroup
from lever_actors.bench.results import Machine
from lever_actors.bench.run import measure_disk
from lever_actors.checkpoints.gguf_layout import gguf_layout
from lever_actors.checkpoints.real_pair import real_model_path
from lever_actors.paths import default_cache_dir
from lever_actors.progress import ProgressLine
from lever_actors.sizes import parse_bytes

RESULTS = Path(__file__).parent / "results"
PROMPT = "def fibonacci(n):"
LLAMA_CONTEXT = 512  # llama-completion's KV: the model's 32,768 positions would take 1.9 GB
RUN_SECONDS = 300  # a run that thrashes is stopped (llama.cpp's mapped file under 2 GiB)


class Shape(msgspec.Struct, frozen=True):
    layers: int
    d_model: int
    ffn: int
    heads: int
    kv_heads: int


# Qwen2.5-7B's, but for its vocabulary: the embedding and the LM head take the tokenizer's
# 151,936 rows (the 7B pads them to 152,064, which llama.cpp refuses beside this tokenizer)
QWEN25_7B = Shape(layers=28, d_model=3584, ffn=18944, heads=28, kv_heads=4)
Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K


def quantized(rows: int, cols: int, kind: gguf.GGMLQuantizationType, rng) -> np.ndarray:
    """[rows, bytes a row] of random blocks whose scales are small finite halves: the
    products stay finite, as a real model's do."""
    block, nbytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    if kind == Q4_K:  # d and dmin lead the block
        blocks[:, :, 0:2] = scale
        blocks[:, :, 2:4] = scale
    else:  # Q6_K: d ends it
        blocks[:, :, nbytes - 2 : nbytes] = scale
    return blocks.reshape(rows, -1)


def write_synthetic(path: Path, shape: Shape, tokenizer_source: Path, seed: int = 0) -> None:
    """The GGUF of `shape` with random weights and `tokenizer_source`'s tokenizer."""
    rng = np.random.default_rng(seed)
    source = gguf.GGUFReader(tokenizer_source)
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_name("synthetic Qwen2.5-7B shape (random weights)")
    writer.add_block_count(shape.layers)
    writer.add_context_length(32768)
    writer.add_embedding_length(shape.d_model)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(15)  # mostly Q4_K_M
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            _copy_field(writer, name, field)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    head_dim = shape.d_model // shape.heads
    kv = shape.kv_heads * head_dim
    d, f = shape.d_model, shape.ffn

    def norm(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    writer.add_tensor("token_embd.weight", quantized(vocab, d, Q4_K, rng), raw_dtype=Q4_K)
    for i in range(shape.layers):
        big = Q6_K if i % 2 == 0 else Q4_K  # half the layers: Q6_K attn_v and ffn_down
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", norm(d))
        writer.add_tensor(b + "attn_q.weight", quantized(d, d, Q4_K, rng), raw_dtype=Q4_K)
        writer.add_tensor(b + "attn_q.bias", np.zeros(d, dtype=np.float32))
        writer.add_tensor(b + "attn_k.weight", quantized(kv, d, Q4_K, rng), raw_dtype=Q4_K)
        writer.add_tensor(b + "attn_k.bias", np.zeros(kv, dtype=np.float32))
        writer.add_tensor(b + "attn_v.weight", quantized(kv, d, big, rng), raw_dtype=big)
        writer.add_tensor(b + "attn_v.bias", np.zeros(kv, dtype=np.float32))
        writer.add_tensor(b + "attn_output.weight", quantized(d, d, Q4_K, rng), raw_dtype=Q4_K)
        writer.add_tensor(b + "ffn_norm.weight", norm(d))
        writer.add_tensor(b + "ffn_gate.weight", quantized(f, d, Q4_K, rng), raw_dtype=Q4_K)
        writer.add_tensor(b + "ffn_up.weight", quantized(f, d, Q4_K, rng), raw_dtype=Q4_K)
        writer.add_tensor(b + "ffn_down.weight", quantized(d, f, big, rng), raw_dtype=big)
    writer.add_tensor("output_norm.weight", norm(d))
    writer.add_tensor("output.weight", quantized(vocab, d, Q6_K, rng), raw_dtype=Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _copy_field(writer: gguf.GGUFWriter, name: str, field) -> None:
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        item = field.types[1]
        values = [field.parts[i] for i in field.data]
        if item == gguf.GGUFValueType.STRING:
            writer.add_array(name, [bytes(v).decode("utf-8", "surrogateescape") for v in values])
        else:
            writer.add_array(name, [v.tolist()[0] for v in values])
    elif kind == gguf.GGUFValueType.STRING:
        writer.add_string(name, bytes(field.parts[field.data[0]]).decode())
    else:
        value = field.parts[field.data[0]].tolist()[0]
        writer.add_key_value(name, value, kind)


def in_cgroup(limit: str, argv: list[str]) -> tuple[float, str]:
    """Run `argv` in a new cgroup of `limit` (entered before exec), for at most
    RUN_SECONDS; its wall seconds and its output."""
    support = probe_cgroup()
    if not support.usable:
        raise SystemExit(f"no usable memory cgroup: {support.describe()}")
    cgroup = MemoryCgroup(support, f"lever-synthetic-{os.getpid()}", parse_bytes(limit))
    started = time.perf_counter()
    try:
        done = subprocess.run(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=lambda: cgroup.add(os.getpid()),
            timeout=RUN_SECONDS,
        )
        return time.perf_counter() - started, done.stdout + _ending(done.returncode)
    except subprocess.TimeoutExpired as e:
        text = e.output if isinstance(e.output, str) else (e.output or b"").decode()
        return time.perf_counter() - started, text + f"\n(stopped after {RUN_SECONDS} s)"
    finally:
        cgroup.remove()


# a fresh process mapping and touching N bytes of anonymous memory, as the resident weights'
# buffers are (4 KiB pages); prints the seconds that took
FAULT_IN = """
import mmap, sys, time
import numpy as np
n = int(sys.argv[1])
started = time.perf_counter()
memory = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
np.frombuffer(memory, dtype=np.uint8)[::4096] = 1
print(time.perf_counter() - started)
"""


def fault_in_seconds(nbytes: int) -> float:
    """The time a fresh process takes to fault in `nbytes` of new memory on one thread: a
    load of that many resident bytes pays it too (on a VM it can exceed the disk's time)."""
    done = subprocess.run(
        [sys.executable, "-c", FAULT_IN, str(nbytes)], capture_output=True, text=True, check=True
    )
    return float(done.stdout)


def _ending(status: int) -> str:
    """How a run ended, after its output: killed by the limit shows as signal 9."""
    return "" if status == 0 else f"\n(exit status {status})"


def figure(pattern: str, text: str) -> float | None:
    found = re.search(pattern, text)
    return float(found.group(1).replace(",", "")) if found else None


def per_token_bytes(text: str) -> float | None:
    """`generate`'s "N KiB read per token" (or MiB, GiB) in bytes."""
    found = re.search(r"([\d.,]+) (KiB|MiB|GiB) read per token", text)
    if not found:
        return None
    return (
        float(found.group(1).replace(",", ""))
        * 2 ** {"KiB": 10, "MiB": 20, "GiB": 30}[found.group(2)]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limits", default="2GiB,3GiB,4GiB")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS / "synthetic-7b.json")
    args = parser.parse_args()
    cache = default_cache_dir()
    model = cache / "synthetic-qwen2.5-7b-q4_k_m.gguf"
    if not model.exists():
        print(f"writing {model} ...", file=sys.stderr)
        partial = model.with_suffix(".partial")
        write_synthetic(partial, QWEN25_7B, real_model_path(cache, "target", ProgressLine()))
        partial.rename(model)
    started = time.perf_counter()
    layout = gguf_layout(model, cache, ProgressLine())  # once: outside any limit
    layout_seconds = time.perf_counter() - started
    weights = layout / "weights.bin"
    profiles = [measure_disk(layout) for _ in range(3)]  # the median: this disk is noisy
    disk = statistics.median(p.bandwidth for p in profiles if p is not None)
    lever = [str(Path(sys.executable).parent / "lever-actors")]
    llama = cache / "llama.cpp" / "bin" / "llama-completion"
    runs = []
    for limit in args.limits.split(","):
        evict_from_page_cache([model, weights])
        ours_s, ours = in_cgroup(
            limit,
            [
                *lever,
                "generate",
                "--target",
                str(model),
                "--plan",
                "ar",
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                str(args.tokens),
            ],
        )
        evict_from_page_cache([model, weights])
        theirs_s, theirs = in_cgroup(
            limit,
            [
                str(llama),
                "-m",
                str(model),
                "-p",
                PROMPT,
                "-n",
                str(args.tokens),
                "-c",
                str(LLAMA_CONTEXT),
                "-t",
                "2",
                "--temp",
                "0",
                "-no-cnv",
            ],
        )
        resident = figure(r"([\d.]+) GiB of target weights in DRAM", ours)
        load = figure(r"loaded in ([\d.]+) s", ours)
        read_check = resident * 2**30 / disk if resident is not None else None
        fault_in = fault_in_seconds(int(resident * 2**30)) if resident is not None else None
        per_token = per_token_bytes(ours)
        rate = figure(r"decode ([\d.]+) tok/s", ours)
        run = {
            "limit": limit,
            "ours": {
                "launch_to_exit_s": round(ours_s, 2),
                "loaded_s": load,
                "resident_gib": resident,
                "read_and_check_s": round(read_check, 2) if read_check else None,
                "load_over_read_and_check": round(load / read_check, 2)
                if load and read_check
                else None,
                "fault_in_s": round(fault_in, 2) if fault_in else None,
                "load_over_fault_in": round(load / fault_in, 2) if load and fault_in else None,
                "first_token_s": figure(r"first token after ([\d.]+) s", ours),
                "decode_tok_s": rate,
                "read_per_token_mib": round(per_token / 2**20, 1) if per_token else None,
                "disk_share": round(rate * per_token / disk, 2) if rate and per_token else None,
                "output_tail": ours[-1500:],
            },
            "llama_completion": {
                "launch_to_exit_s": round(theirs_s, 2),
                "decode_tok_s": figure(
                    r"(?<!prompt )eval time =.*?([\d.]+) tokens per second\)", theirs
                ),
                "output_tail": theirs[-1500:],
            },
        }
        runs.append(run)
        print(json.dumps({k: v for k, v in run["ours"].items() if k != "output_tail"}))
        print(json.dumps({k: v for k, v in run["llama_completion"].items() if k != "output_tail"}))
    record = {
        "command": " ".join(["benchmarks/synthetic_scale.py", *sys.argv[1:]]),
        "machine": msgspec.to_builtins(Machine.here()),
        "shape": msgspec.to_builtins(QWEN25_7B),
        "gguf_bytes": model.stat().st_size,
        "layout_s": round(layout_seconds, 1),  # converted, or found where converted before
        "disk_o_direct_bytes_per_s": disk,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"results: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
