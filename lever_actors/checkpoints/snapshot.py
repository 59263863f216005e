"""A loaded checkpoint saved as it sits in DRAM (our formats, ties kept), so that the next
load of the same source reads it back instead of converting again.

Loading the real draft from its GGUF took 12.7 s (5.1 s parsing the vocabulary's metadata,
6.7 s converting blocks to our formats); its snapshot loads in well under a second. A
snapshot lives in the cache under a key of the source (path, size, modification time),
the load's dtype and formats, and this package's version: any change makes a new one.
It is written whole to a partial directory and renamed (checkpoints/new_directory.py),
so a killed write leaves nothing that loads; one that fails to load is replaced.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

import lever_actors
from lever_actors.checkpoints.checkpoint import Checkpoint
from lever_actors.checkpoints.new_directory import new_directory
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.errors import CheckpointError
from lever_actors.logs import get_logger
from lever_actors.model.args import ModelArgs
from lever_actors.model.quantized import QuantizedRows, QuantizedWeight
from lever_actors.model.weights import ModelWeights, StoredWeight, Weight
from lever_actors.paths import file_identity

log = get_logger(__name__)

TENSORS = "weights.safetensors"
STRUCTURE = "model.json"
KEPT = 4  # snapshots kept in a cache directory, the most recently used


def snapshot_key(source: Path, *choices: str) -> str:
    """Names the snapshot of `source` loaded with `choices` (dtype, formats)."""
    parts = [*map(str, file_identity(source)), *choices, lever_actors.__version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def load_via_snapshot(
    cache: Path, key: str, load: Callable[[], Checkpoint], source: Path
) -> Checkpoint:
    """The checkpoint saved as `key` in `cache` if there is a sound one; else `load()`, saved
    there for next time (a failure to save costs only the saving). Only the KEPT most
    recently used snapshots stay."""
    directory = cache / key
    if directory.is_dir():
        try:
            checkpoint = read_snapshot(directory, source)
            directory.touch()  # used: the last to go
            return checkpoint
        except (CheckpointError, OSError, ValueError, KeyError, SafetensorError) as error:
            log.warning("snapshot.unreadable", path=str(directory), error=str(error))
            shutil.rmtree(directory, ignore_errors=True)
    checkpoint = load()
    try:
        with new_directory(directory) as tmp:
            write_snapshot(checkpoint, tmp)
    except (CheckpointError, OSError) as error:
        log.warning("snapshot.not_saved", path=str(directory), error=str(error))
    _forget_all_but_recent(cache)
    return checkpoint


def _forget_all_but_recent(cache: Path) -> None:
    snapshots = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    snapshots.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for old in snapshots[KEPT:]:
        shutil.rmtree(old, ignore_errors=True)


def write_snapshot(checkpoint: Checkpoint, directory: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    w = checkpoint.weights
    structure = {
        "args": msgspec.to_builtins(checkpoint.args),
        "embed": _describe(w.embed, "embed", tensors),
        "final_norm": _describe(w.final_norm, "final_norm", tensors),
        "lm_head": "embed" if w.lm_head is w.embed else _describe(w.lm_head, "lm_head", tensors),
        "head_copies_embed": w.head_copies_embed,
        "layers": [
            {name: _describe(t, f"layers.{i}.{name}", tensors) for name, t in layer.items()}
            for i, layer in enumerate(w.layers)
        ],
        "tokenizer": checkpoint.tokenizer is not None,
    }
    save_file(tensors, str(directory / TENSORS))
    if checkpoint.tokenizer is not None:
        checkpoint.tokenizer.save(directory)
    (directory / STRUCTURE).write_text(json.dumps(structure))


def read_snapshot(directory: Path, source: Path) -> Checkpoint:
    structure = json.loads((directory / STRUCTURE).read_text())
    tensors = _aligned_tensors(directory / TENSORS)
    embed = _rebuild(structure["embed"], tensors)
    lm_head = embed if structure["lm_head"] == "embed" else _rebuild(structure["lm_head"], tensors)
    weights = ModelWeights(
        embed=embed,
        final_norm=_dense(_rebuild(structure["final_norm"], tensors)),
        lm_head=lm_head,
        layers=[
            {name: _rebuild(d, tensors) for name, d in layer.items()}
            for layer in structure["layers"]
        ],
        head_copies_embed=structure["head_copies_embed"],
    )
    tokenizer = (
        Tokenizer.from_file(directory / "tokenizer.json") if structure["tokenizer"] else None
    )
    args = msgspec.convert(structure["args"], ModelArgs)
    return Checkpoint(args=args, weights=weights, tokenizer=tokenizer, source=source)


def _aligned_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Each tensor copied out of the file's memory map into torch's own, 64-byte aligned
    memory: our kernels' and torch's packed products assume it (a tensor at the file's
    offset crashed them)."""
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name).clone() for name in f.keys()}


def _describe(weight: Weight, name: str, tensors: dict[str, torch.Tensor]) -> Any:
    """How to rebuild `weight`, its tensors put in `tensors` under names starting `name`."""
    if isinstance(weight, torch.Tensor):
        tensors[name] = weight.contiguous()
        return {"kind": "dense", "tensor": name}
    if isinstance(weight, QuantizedRows):
        tensors[name] = weight.records.contiguous()
        return {"kind": "rows", "shape": list(weight.shape), "tensor": name}
    if isinstance(weight, QuantizedWeight):
        tensors[f"{name}.data"] = weight.data.contiguous()
        tensors[f"{name}.scales"] = weight.scales.contiguous()
        return {
            "kind": "quantized",
            "fmt": weight.fmt,
            "shape": list(weight.shape),
            "exact": weight.exact,
            "tensor": name,
        }
    raise CheckpointError(f"cannot snapshot a weight of type {type(weight).__name__}")


def _rebuild(description: dict[str, Any], tensors: dict[str, torch.Tensor]) -> StoredWeight:
    name, kind = description["tensor"], description["kind"]
    if kind == "dense":
        return tensors[name]
    shape = tuple(description["shape"])
    if kind == "rows":
        return QuantizedRows(shape, tensors[name])  # type: ignore[arg-type]
    if kind == "quantized":
        return QuantizedWeight(
            description["fmt"],
            shape,  # type: ignore[arg-type]
            tensors[f"{name}.data"],
            tensors[f"{name}.scales"],
            description["exact"],
        )
    raise CheckpointError(f"snapshot: unknown weight kind {kind!r}")


def _dense(weight: StoredWeight) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):
        raise CheckpointError("snapshot: the final norm is not a dense tensor")
    return weight
