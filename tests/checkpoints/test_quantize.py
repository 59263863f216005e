"""Quantized checkpoints: each tensor's format as `--weights` chooses, Q4_K blocks converted
without requantizing, layouts that store the formats and read back what was written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.gguf_file import load_gguf
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.checkpoints.quantize import quantize_by_rows, quantize_tensor, tensor_format
from lever_actors.device.flash import FlashStore
from lever_actors.errors import ConfigError
from lever_actors.model.quantized import QuantizedRows, QuantizedWeight, dense_values
from lever_actors.model.transformer import Transformer
from tests.checkpoints.test_gguf import D_MODEL, VOCAB, write_gguf

BF16 = torch.bfloat16


def _formats(weights) -> dict[str, str]:
    def fmt(t) -> str:
        if isinstance(t, QuantizedWeight):
            return t.fmt
        return "int4rows" if isinstance(t, QuantizedRows) else "dense"

    return {name: fmt(t) for name, t in weights.layers[0].items()} | {
        "embed": fmt(weights.embed),
        "lm_head": fmt(weights.lm_head),
    }


def test_auto_keeps_each_tensor_in_its_precision_class(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "qwen2")  # q: Q8_0, k: Q5_0, v: BF16, o: F16, gate: Q4_K, up: Q6_K
    formats = _formats(load_gguf(path, BF16, "auto").weights)
    assert formats == {
        "attn_norm": "dense",
        "wq": "int8",
        "wk": "q4k",  # Q5_0, rounded to nearest into q4k for its kernel
        "wv": "dense",
        "wo": "dense",
        "ffn_norm": "dense",
        "w_gate": "q4k",  # its values, in our packing
        "w_up": "q6k",  # its blocks as stored
        "w_down": "dense",
        "bq": "dense",
        "bk": "dense",
        "bv": "dense",
        "embed": "dense",  # F16
        "lm_head": "int8",  # Q8_0
    }


def test_q4k_blocks_keep_their_values(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = write_gguf(path, "llama", layer_types={"attn_q.weight": Q.Q4_K})
    layers = load_gguf(path, BF16, "auto").weights.layers
    for i, layer in enumerate(layers):
        for ours, name in (("w_gate", "ffn_gate"), ("wq", "attn_q")):  # wq: rows unpermuted
            want = torch.from_numpy(expected[f"blk.{i}.{name}.weight"]).float()
            got = layer[ours]
            assert isinstance(got, QuantizedWeight) and got.fmt == "q4k"
            assert torch.equal(got.dequantize(), want)


def test_q4k_blocks_convert_to_int4_up_to_the_rounding_of_their_scales(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = write_gguf(path, "llama", layer_types={"attn_q.weight": Q.Q4_K})
    layers = load_gguf(path, BF16, "q4").weights.layers
    for i, layer in enumerate(layers):
        for ours, name in (("w_gate", "ffn_gate"), ("wq", "attn_q")):  # wq: rows unpermuted
            want = torch.from_numpy(expected[f"blk.{i}.{name}.weight"]).float()
            got = layer[ours]
            assert isinstance(got, QuantizedWeight) and got.fmt == "int4"
            # scales and zeros are bf16 (8 bits of mantissa), the values then bf16 again
            assert (got.dequantize() - want).abs().max() <= 2**-7 * want.abs().max()


def test_q4_quantizes_every_matrix_and_unties_a_row_read_table(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    write_gguf(path, "qwen3", tied=True)
    checkpoint = load_gguf(path, BF16, "q4")
    formats = _formats(checkpoint.weights)
    assert formats["embed"] == "int4rows"
    assert formats["lm_head"] == "int8"  # 40 rows cannot take the int4 packing's 16s
    assert {formats[n] for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")} == {"int4"}
    assert not checkpoint.args.tie_embeddings
    table = dense_values(checkpoint.weights.embed).float()
    head = dense_values(checkpoint.weights.lm_head).float()
    assert (table - head).abs().max() <= 0.1 * table.abs().max()  # the same values, re-rounded
    assert checkpoint.weights.head_copies_embed


def test_a_draft_reads_its_embedding_from_the_head_that_copies_it(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    write_gguf(path, "qwen3", tied=True)
    weights = load_gguf(path, BF16, "q4").weights
    drafting = weights.for_drafting()
    assert drafting.embed is drafting.lm_head  # one table in DRAM, not two
    assert drafting.nbytes == weights.nbytes - weights.embed.nbytes  # and counted once
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(drafting.embed[ids], dense_values(weights.lm_head)[ids].to(BF16))


def test_a_head_stored_beside_the_table_it_copies_is_found_by_its_values(tmp_path: Path) -> None:
    table = np.random.default_rng(1).standard_normal((VOCAB, D_MODEL))
    write_gguf(
        tmp_path / "twice.gguf", "qwen2", exact={"token_embd.weight": table, "output.weight": table}
    )
    twice = load_gguf(tmp_path / "twice.gguf", BF16, "q4").weights
    drafting = twice.for_drafting()
    assert twice.head_copies_embed and drafting.embed is drafting.lm_head
    write_gguf(tmp_path / "untied.gguf", "qwen2")  # a head of other values
    untied = load_gguf(tmp_path / "untied.gguf", BF16, "q4").weights
    assert not untied.head_copies_embed and untied.for_drafting().embed is untied.embed


def test_choices_are_checked() -> None:
    with pytest.raises(ConfigError, match="expected one of dense, auto, q4, q4k, q6, q8"):
        load_checkpoint("unused", BF16, "q3")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="quantized weights compute in bfloat16"):
        load_checkpoint("unused", torch.float64, "q4")
    assert tensor_format("q4", "wq", (24, 256)) == "int8"  # outputs not in 16s
    assert tensor_format("q4", "embed", (40, 48)) == "dense"  # inputs not in 32s
    assert tensor_format("auto", "wq", (256, 256), "F16") == "dense"
    assert tensor_format("q8", "attn_norm", (256,)) == "dense"
    assert tensor_format("q6", "wq", (64, 224)) == "int8"  # inputs not in blocks of 256
    assert tensor_format("auto", "embed", (40, 256), "Q6_K") == "dense"
    assert tensor_format("auto", "embed", (40, 256), "Q4_K") == "int4rows"
    assert tensor_format("q4k", "wq", (64, 224)) == "q4k"  # its last block padded
    assert tensor_format("q4k", "wq", (64, 240)) == "int8"  # inputs not in groups of 32
    assert tensor_format("q4k", "wq", (24, 256)) == "q4k"  # outputs in 8s (int4 needs 16s)


@pytest.mark.parametrize("weights", ["auto", "q4", "q4k", "q6", "q8"])
def test_a_quantized_layout_reads_back_what_was_written(tmp_path: Path, weights: str) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "qwen2")
    in_dram = load_gguf(path, BF16, weights)  # type: ignore[arg-type]
    manifest = convert(path, tmp_path / "layout", BF16, weights=weights)  # type: ignore[arg-type]
    stored = {t.name: t.format for t in manifest.extent("layer.0").tensors}
    assert stored == {n: f for n, f in _formats(in_dram.weights).items() if n in stored}
    from_layout = load_checkpoint(tmp_path / "layout", BF16)
    tokens = torch.tensor([1, 5, 9, 2, 33])
    ours = Transformer(in_dram.args, in_dram.weights)
    theirs = Transformer(from_layout.args, from_layout.weights)
    logits = [m.logits(m.forward(tokens, m.new_cache(8))) for m in (ours, theirs)]
    assert torch.equal(*logits)
    if weights == "q4":
        store = FlashStore(tmp_path / "layout")
        try:
            rows = store.read_rows(manifest.extent("embed"), [3, 0, 39])
        finally:
            store.close()
        assert torch.equal(rows, in_dram.weights.embed[torch.tensor([3, 0, 39])])


def test_quantized_layout_is_smaller_than_dense(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "qwen2", layer_types={k: Q.Q4_K for k in ("attn_q.weight", "ffn_up.weight")})
    dense = convert(path, tmp_path / "dense", BF16, weights="dense").file_bytes
    quantized = convert(path, tmp_path / "q4", BF16, weights="q4").file_bytes
    assert quantized < 0.45 * dense


@pytest.mark.parametrize("fmt", ["int8", "q6k", "int4rows"])
def test_row_wise_formats_quantize_the_same_in_chunks(fmt: str) -> None:
    values = torch.randn(70, 256, generator=torch.Generator().manual_seed(0))
    whole = quantize_tensor(values, fmt, BF16)
    chunked = quantize_by_rows(values.split(16), fmt, (70, 256))
    assert torch.equal(dense_values(chunked), dense_values(whole))
