"""Convert an HF directory or GGUF file into the flash layout (see device/layout.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import torch

from lever_actors.checkpoints.checkpoint import Checkpoint
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.checkpoints.new_directory import new_directory
from lever_actors.config import Weights
from lever_actors.device.checksums import checksum, chunk_checksums
from lever_actors.device.layout import DTYPE_NAMES
from lever_actors.device.manifest import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    ROW_READ_EXTENTS,
    TOKENIZER_NAME,
    WEIGHTS_NAME,
    Extent,
    Manifest,
    TensorEntry,
    align_up,
    layer_key,
)
from lever_actors.errors import CheckpointError
from lever_actors.model.formats import Format
from lever_actors.model.quantized import QuantizedRows, QuantizedWeight
from lever_actors.model.shapes import layer_tensor_names
from lever_actors.model.weights import StoredWeight, Weight, stored
from lever_actors.progress import Progress

TENSOR_ALIGNMENT = 64  # tensors inside an extent start on cache-line boundaries


def convert(
    src: Path,
    out: Path,
    dtype: torch.dtype,
    progress: Progress | None = None,
    weights: Weights = "dense",
) -> Manifest:
    """Write the flash layout of `src` to directory `out`, which must not exist yet, its
    matrices in the formats `weights` chooses (checkpoints/quantize.py).

    Everything is written under a temporary name beside `out` and renamed at the end, so an
    interrupted conversion leaves nothing that loads.
    """
    if dtype not in DTYPE_NAMES.values():
        raise CheckpointError(f"cannot store weights as {dtype}; choose one of {list(DTYPE_NAMES)}")
    with new_directory(out) as tmp:
        checkpoint = load_checkpoint(src, dtype, weights)
        extents = _write_weights(checkpoint, tmp / WEIGHTS_NAME, progress)
        tokenizer = None
        if checkpoint.tokenizer is not None:
            checkpoint.tokenizer.save(tmp)
            tokenizer = TOKENIZER_NAME
        manifest = Manifest(
            version=MANIFEST_VERSION,
            args=checkpoint.args,
            dtype=next(name for name, d in DTYPE_NAMES.items() if d == dtype),
            source=str(src),
            extents=tuple(extents),
            tokenizer=tokenizer,
        )
        (tmp / MANIFEST_NAME).write_bytes(msgspec.json.format(msgspec.json.encode(manifest)))
    return manifest


def _extent_tensors(checkpoint: Checkpoint) -> Iterator[tuple[str, list[tuple[str, Weight]]]]:
    """Extents in file order: embedding, layers, final norm, then the LM head unless tied."""
    w = checkpoint.weights
    yield "embed", [("embed", w.embed)]
    names = layer_tensor_names(checkpoint.args)
    for i, layer in enumerate(w.layers):
        yield layer_key(i), [(name, layer[name]) for name in names]
    yield "final_norm", [("final_norm", w.final_norm)]
    if not checkpoint.args.tie_embeddings:
        yield "lm_head", [("lm_head", w.lm_head)]


def _write_weights(checkpoint: Checkpoint, path: Path, progress: Progress | None) -> list[Extent]:
    planned = list(_extent_tensors(checkpoint))
    total = sum(_nbytes(t) for _, tensors in planned for _, t in tensors)
    done = 0
    extents = []
    with open(path, "wb") as f:
        for key, tensors in planned:
            start = f.tell()
            entries = []
            for name, tensor in tensors:
                f.write(bytes(-(f.tell() - start) % TENSOR_ALIGNMENT))
                data = _bytes(stored(tensor))
                entries.append(
                    TensorEntry(
                        name=name,
                        offset=f.tell() - start,
                        nbytes=len(data),
                        dtype=str(tensor.dtype).removeprefix("torch."),
                        shape=tuple(tensor.shape),
                        checksum=checksum(data),
                        chunk_checksums=chunk_checksums(data) if key in ROW_READ_EXTENTS else (),
                        format=_format(tensor),
                    )
                )
                f.write(data)
                done += len(data)
                if progress:
                    progress(done, total, f"convert {key}")
            f.write(bytes(align_up(f.tell()) - f.tell()))
            extents.append(
                Extent(key=key, offset=start, nbytes=f.tell() - start, tensors=tuple(entries))
            )
        f.flush()
        os.fsync(f.fileno())
    return extents


def _format(tensor: Weight) -> Format:
    if isinstance(tensor, QuantizedWeight):
        return tensor.fmt
    return "int4rows" if isinstance(tensor, QuantizedRows) else "dense"


def _bytes(tensor: StoredWeight) -> bytes:
    if isinstance(tensor, torch.Tensor):
        return tensor.contiguous().view(torch.uint8).numpy().tobytes()
    return tensor.to_bytes()


def _nbytes(tensor: Weight) -> int:
    return (
        tensor.numel() * tensor.element_size()
        if isinstance(tensor, torch.Tensor)
        else tensor.nbytes
    )
