"""The flash layout: one weights file of 4 KiB-aligned extents, described by a manifest.

An extent is everything one step reads at once: a whole layer, the LM head, the final
norm, or the embedding table (which is read a row at a time). Tensor offsets inside an
extent are relative to the extent's start.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch

from lever_actors.errors import CheckpointError
from lever_actors.model.args import ModelArgs

MANIFEST_VERSION = 1
ALIGNMENT = 4096  # O_DIRECT needs block-aligned offsets, lengths and buffers
MANIFEST_NAME = "manifest.json"
WEIGHTS_NAME = "weights.bin"
TOKENIZER_NAME = "tokenizer.json"

DTYPE_NAMES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


class TensorEntry(msgspec.Struct, frozen=True):
    name: str
    offset: int  # from the start of its extent
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    crc32: int


class Extent(msgspec.Struct, frozen=True):
    key: str  # "layer.<i>", "embed", "final_norm" or "lm_head"
    offset: int  # in the weights file, a multiple of ALIGNMENT
    nbytes: int  # a multiple of ALIGNMENT: what one read of the extent transfers
    tensors: tuple[TensorEntry, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


class Manifest(msgspec.Struct, frozen=True):
    version: int
    args: ModelArgs
    dtype: str
    source: str  # the checkpoint this layout was converted from
    extents: tuple[Extent, ...]
    tokenizer: str | None = None  # file beside the manifest

    def extent(self, key: str) -> Extent:
        for extent in self.extents:
            if extent.key == key:
                return extent
        raise KeyError(key)

    def layer(self, index: int) -> Extent:
        return self.extent(layer_key(index))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPE_NAMES[self.dtype]

    @property
    def file_bytes(self) -> int:
        return max(e.offset + e.nbytes for e in self.extents)


def layer_key(index: int) -> str:
    return f"layer.{index}"


def align_up(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a flash layout (no {MANIFEST_NAME})")
    raw = path.read_bytes()
    try:
        version = msgspec.json.decode(raw, type=_VersionOnly).version
    except msgspec.DecodeError as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e})") from None
    if version != MANIFEST_VERSION:
        raise CheckpointError(
            f"{path}: manifest version {version}, this lever_actors reads version "
            f"{MANIFEST_VERSION}; convert the checkpoint again"
        )
    try:
        return msgspec.json.decode(raw, type=Manifest)
    except msgspec.ValidationError as e:
        raise CheckpointError(f"{path}: invalid manifest ({e})") from None


class _VersionOnly(msgspec.Struct):
    version: int
