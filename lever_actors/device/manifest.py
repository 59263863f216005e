"""The flash layout: one weights file of 4 KiB-aligned extents, described by a manifest
(this module, without torch; device/layout.py makes the stored bytes torch's weights).

An extent is everything one step reads at once: a whole layer, the LM head, the final
norm, or the embedding table (which is read a row at a time). Tensor offsets inside an
extent are relative to the extent's start.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from lever_actors.device.checksums import CHUNK_BYTES
from lever_actors.errors import CheckpointError
from lever_actors.model.args import ModelArgs, check_args
from lever_actors.model.formats import (
    ROW_MATRIX_FORMATS,
    Format,
    check_quantizable,
    row_bytes,
    storage_bytes,
)
from lever_actors.model.shapes import expected_shapes, layer_tensor_names

# 2: per-chunk checksums of tensors read by rows; 3: int4 packed alike on every CPU; 4: Q6_K
# kept as its blocks (q6k); 5: Q4_K's values kept (q4k)
MANIFEST_VERSION = 5
ALIGNMENT = 4096  # O_DIRECT needs block-aligned offsets, lengths and buffers
MANIFEST_NAME = "manifest.json"
WEIGHTS_NAME = "weights.bin"
GLOBAL_EXTENTS = ("embed", "final_norm", "lm_head")  # each holds the one tensor of its name
ROW_READ_EXTENTS = ("embed",)  # read a row at a time, so checksummed per chunk as well
# formats whose rows lie whole in one range of bytes (a quantized matrix's scales in a range
# of their own), so that a tensor can stream a range of rows at a time
ROW_STREAMED_FORMATS = ("dense", *ROW_MATRIX_FORMATS)
TOKENIZER_NAME = "tokenizer.json"

DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}  # a dense element's bytes


class TensorEntry(msgspec.Struct, frozen=True):
    name: str
    offset: int  # from the start of its extent
    nbytes: int
    dtype: str  # of a dense tensor; a quantized one computes in it
    shape: tuple[int, ...]  # logical: a quantized [out, in] matrix is [out, in]
    checksum: int  # of all its bytes (device/checksums.py)
    # of each CHUNK_BYTES piece, for tensors read a row at a time (the embedding table)
    chunk_checksums: tuple[int, ...] = ()
    format: Format = "dense"  # or one of model/quantized.py's formats


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
    def file_bytes(self) -> int:
        return max(e.offset + e.nbytes for e in self.extents)


def layer_key(index: int) -> str:
    return f"layer.{index}"


def align_up(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def manifest_version(directory: Path) -> int | None:
    """The version a layout's manifest declares; None if it has no readable one."""
    try:
        return _declared_version((directory / MANIFEST_NAME).read_bytes())
    except (OSError, msgspec.DecodeError):
        return None


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{directory}: not a flash layout (no {MANIFEST_NAME}) nor a GGUF file; "
            "`lever-actors convert` makes a layout of a checkpoint"
        )
    raw = path.read_bytes()
    try:
        version = _declared_version(raw)
    except msgspec.DecodeError as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e})") from None
    if version != MANIFEST_VERSION:
        raise CheckpointError(
            f"{path}: manifest version {version}, this lever_actors reads version "
            f"{MANIFEST_VERSION}; convert the checkpoint again"
        )
    try:
        manifest = msgspec.json.decode(raw, type=Manifest)
    except msgspec.DecodeError as e:
        raise CheckpointError(f"{path}: invalid manifest ({e})") from None
    return check_manifest(manifest, str(path))


def check_manifest(manifest: Manifest, source: str) -> Manifest:
    """`manifest` if it describes the layout its args imply: the expected extents at aligned
    offsets, each holding the tensors of the shapes expected_shapes gives, in the layout's
    dtype, with sizes that agree and inside the extent; else a CheckpointError naming `source`."""
    args = check_args(manifest.args, source)
    if manifest.dtype not in DTYPE_SIZES:
        raise CheckpointError(
            f"{source}: dtype {manifest.dtype!r} is not one of {', '.join(DTYPE_SIZES)}"
        )
    _check_extent_keys(manifest.extents, args, source)
    shapes = expected_shapes(args)
    for extent in manifest.extents:
        _check_extent(extent, args, source)
        for entry in extent.tensors:
            _check_tensor(entry, extent, shapes[entry.name], manifest.dtype, source)
    return manifest


def _check_extent_keys(extents: tuple[Extent, ...], args: ModelArgs, source: str) -> None:
    globals_ = GLOBAL_EXTENTS[:2] if args.tie_embeddings else GLOBAL_EXTENTS
    count = len(globals_) + args.n_layers
    # counted first: a corrupt n_layers of 10**15 must not build that many keys
    if len(extents) != count:
        raise CheckpointError(
            f"{source}: {len(extents)} extents, but n_layers = {args.n_layers} and "
            f"tie_embeddings = {args.tie_embeddings} make {count}"
        )
    keys = {e.key for e in extents}
    expected = {*globals_, *(layer_key(i) for i in range(args.n_layers))}
    if keys != expected:  # with the count equal, this also catches a repeated key
        extra = sorted(keys - expected)
        raise CheckpointError(
            f"{source}: no extent {sorted(expected - keys)[0]!r}"
            + (f" (unexpected extent {extra[0]!r})" if extra else " (a key is repeated)")
        )


def _check_extent(extent: Extent, args: ModelArgs, source: str) -> None:
    where = f"{source}: extent {extent.key}"
    for field, value in (("offset", extent.offset), ("nbytes", extent.nbytes)):
        if value < 0 or value % ALIGNMENT:
            raise CheckpointError(
                f"{where}: {field} = {value} is not a non-negative multiple of {ALIGNMENT}"
            )
    names = sorted(t.name for t in extent.tensors)
    expected = sorted(layer_tensor_names(args) if extent.key.startswith("layer.") else [extent.key])
    if names != expected:
        raise CheckpointError(f"{where}: holds tensors {names}, expected {expected}")


def _check_tensor(
    entry: TensorEntry, extent: Extent, shape: tuple[int, ...], dtype: str, source: str
) -> None:
    where = f"{source}: tensor {entry.name!r} of {extent.key}"
    if entry.dtype != dtype:
        raise CheckpointError(f"{where}: dtype {entry.dtype!r}, the layout's is {dtype!r}")
    if entry.shape != shape:
        raise CheckpointError(f"{where}: shape {entry.shape}, args imply {shape}")
    unfit = check_quantizable(shape, entry.format)
    if unfit is not None:
        raise CheckpointError(f"{where}: {unfit}")
    nbytes = storage_bytes(shape, entry.format, DTYPE_SIZES[dtype])
    if entry.nbytes != nbytes:
        raise CheckpointError(
            f"{where}: nbytes = {entry.nbytes}, its shape, dtype and format make {nbytes}"
        )
    if entry.offset < 0:
        raise CheckpointError(f"{where}: offset = {entry.offset} is negative")
    end = entry.offset + entry.nbytes
    if end > extent.nbytes:
        raise CheckpointError(
            f"{where} ends at byte {end}, past the end of its extent ({extent.nbytes} bytes)"
        )
    chunks = -(-nbytes // CHUNK_BYTES)
    if extent.key in ROW_READ_EXTENTS and len(entry.chunk_checksums) != chunks:
        raise CheckpointError(
            f"{where}: {len(entry.chunk_checksums)} chunk checksums, its {nbytes} bytes make "
            f"{chunks}"
        )


class _VersionOnly(msgspec.Struct):
    version: int


def _declared_version(raw: bytes) -> int:
    """The version a manifest's bytes declare, whatever else they hold."""
    return msgspec.json.decode(raw, type=_VersionOnly).version


def stored_row_bytes(entry: TensorEntry) -> tuple[int, int]:
    """(values, scales) bytes of one row of a row-streamed tensor (dense: no scales)."""
    if entry.format == "dense":
        return entry.nbytes // entry.shape[0], 0
    return row_bytes(entry.format, entry.shape[1])


def stream_buffer_bytes(entry: TensorEntry, rows: int) -> int:
    """The aligned buffer that streams a row-streamed tensor `rows` rows per read, two parts
    at a time (one read while the other is used), each half also able to take a quantized
    tensor's scales in one read."""
    values, scales = stored_row_bytes(entry)
    largest = max(rows * values, scales * entry.shape[0])
    return 2 * (align_up(largest) + 2 * ALIGNMENT)
