"""The target held in DRAM without torch (#63): its layout's extents read (and checked) into
aligned buffers with O_DIRECT, viewed as numpy arrays in place and run by
model/plain_model.py on our plain kernels; the embedding table resident, or its rows read
from flash as tokens need them. What the plain path computes equals what
target.py's FlashTarget computes on torch, bit for bit."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lever_actors.device.manifest import Extent, Manifest, TensorEntry, layer_key
from lever_actors.device.reads import AlignedBuffer, LayoutReader
from lever_actors.model import plain
from lever_actors.model.formats import (
    GROUP,
    LAYER_MATRICES,
    Q4K_OUTPUTS,
    Q4K_RECORD,
    ROW_MATRIX_FORMATS,
    q4k_blocks_of,
    row_bytes,
)
from lever_actors.model.plain_model import DenseRows, Int4Rows, Model, Weights, decode_int4_rows

Array = np.ndarray | plain.Matrix | Int4Rows  # a tensor as the plain path holds it


class PlainTarget:
    """A flash layout's model, every extent resident but, with `embed_resident` False, the
    embedding table, whose rows are then read from flash as tokens need them."""

    def __init__(
        self, directory: Path, *, embed_resident: bool = True, verify: bool = True
    ) -> None:
        self.reader = LayoutReader(directory, verify=verify)
        self.manifest: Manifest = self.reader.manifest
        args = self.manifest.args
        wanted = [e for e in self.manifest.extents if embed_resident or e.key != "embed"]
        try:
            buffers = self.reader.load_all(wanted)
        except BaseException:
            self.reader.close()
            raise
        extents = {e.key: _tensors(e, b) for e, b in zip(wanted, buffers, strict=True)}
        self.bytes_read = self.reader.stats.bytes_read
        embed = _embedding(extents["embed"]["embed"]) if embed_resident else self._streamed()
        head_matrix = extents["lm_head"]["lm_head"]  # plain_formats refused a tied head
        layers = [_layer(extents[layer_key(i)]) for i in range(args.n_layers)]
        final_norm = extents["final_norm"]["final_norm"]
        assert isinstance(head_matrix, plain.Matrix) and isinstance(final_norm, np.ndarray)
        self.model = Model(args, Weights(embed, layers, final_norm, head_matrix))

    def _streamed(self) -> StreamedRows:
        extent = self.manifest.extent("embed")
        if extent.tensors[0].format not in ("dense", "int4rows"):
            raise ValueError("the plain path embeds from a bf16 or int4rows table")
        return StreamedRows(self.reader, extent)

    def close(self) -> None:
        self.reader.close()


class StreamedRows:
    """The embedding table's rows read from flash as tokens need them, each checked."""

    def __init__(self, reader: LayoutReader, extent: Extent) -> None:
        self.reader, self.extent = reader, extent
        self.entry = extent.tensors[0]

    def rows(self, ids: Sequence[int]) -> np.ndarray:
        records = self.reader.row_records(self.extent, list(ids))
        if self.entry.format == "int4rows":
            return decode_int4_rows(records, self.entry.shape[1])
        return records.view(np.uint16).reshape(len(records), -1)


def embed_bytes(manifest: Manifest) -> int:
    """What the embedding table takes resident, which StreamedRows leave on flash."""
    return manifest.extent("embed").nbytes


def plain_formats(manifest: Manifest) -> str:
    """Why the plain path cannot hold this layout's tensors, or '': it computes in bf16 and
    multiplies quantized matrices only."""
    if manifest.dtype != "bfloat16":
        return f"the plain path computes in bf16, not {manifest.dtype}"
    if manifest.args.tie_embeddings:
        return "an LM head tied to the embedding table runs on torch"
    for extent in manifest.extents:
        for entry in extent.tensors:
            if entry.format == "dense" and len(entry.shape) == 2 and entry.name != "embed":
                where = f"{entry.name} of {extent.key}"
                return f"{where} is a dense matrix: the plain path multiplies quantized ones"
    return ""


def _tensors(extent: Extent, buffer: AlignedBuffer) -> dict[str, Array]:
    """An extent's tensors, viewed in place in the buffer it was read into."""
    return {
        t.name: _tensor(t, buffer.array[t.offset : t.offset + t.nbytes]) for t in extent.tensors
    }


def _tensor(entry: TensorEntry, raw: np.ndarray) -> Array:
    """A stored tensor's bytes as the plain path takes them (views, as device/layout.py's
    weight_of makes torch's): a dense one its bf16 bits, a quantized matrix a plain.Matrix,
    the int4rows table an Int4Rows."""
    if entry.format == "dense":
        if entry.dtype != "bfloat16":
            raise ValueError(f"the plain path computes in bf16, not {entry.dtype}")
        return raw.view(np.uint16).reshape(entry.shape)
    if entry.format == "int4rows":
        return Int4Rows(raw.reshape(entry.shape[0], -1), entry.shape[1])
    out, inputs = entry.shape
    if entry.format in ROW_MATRIX_FORMATS:  # rows of values, then rows of scales
        values, _ = row_bytes(entry.format, inputs)
        data: np.ndarray = raw[: out * values].reshape(out, values)
        scales: np.ndarray = raw[out * values :].view(np.uint16).reshape(out, -1)
        if entry.format == "int8":
            data, scales = data.view(np.int8), scales.reshape(out)
        return plain.Matrix(entry.format, (out, inputs), data, scales)
    if entry.format == "q4k":
        records = out // Q4K_OUTPUTS
        split = records * q4k_blocks_of(inputs) * Q4K_RECORD
        data = raw[:split].reshape(records, -1)
        return plain.Matrix(
            "q4k", (out, inputs), data, raw[split:].view(np.uint16).reshape(records, -1)
        )
    split = out * inputs // 2  # int4: the packing, then (scale, zero) per group
    pairs = raw[split:].view(np.uint16).reshape(inputs // GROUP, out, 2)
    return plain.Matrix("int4", (out, inputs), raw[:split].reshape(out, -1), pairs)


def _layer(tensors: dict[str, Array]) -> plain.Layer:
    def vector(name: str) -> np.ndarray:
        value = tensors[name]
        assert isinstance(value, np.ndarray)  # a norm or a bias: dense
        return value

    matrices = [tensors[name] for name in LAYER_MATRICES]
    quantized = [m for m in matrices if isinstance(m, plain.Matrix)]
    if len(quantized) < len(matrices):
        raise ValueError("the plain path multiplies quantized matrices only")
    bq, bk, bv = (vector(b) if b in tensors else None for b in ("bq", "bk", "bv"))
    return plain.Layer(vector("attn_norm"), vector("ffn_norm"), tuple(quantized), bq, bk, bv)


def _embedding(table: Array) -> DenseRows | Int4Rows:
    if isinstance(table, Int4Rows):
        return table
    if isinstance(table, np.ndarray):
        return DenseRows(table)
    raise ValueError("the plain path embeds from a bf16 or int4rows table")
