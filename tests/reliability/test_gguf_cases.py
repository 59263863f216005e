"""GGUF metadata that disagrees with itself or with the tensors: a CheckpointError naming the
file and the field or tensor, before any tensor is dequantized."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGUFValueType as V

from lever_actors.checkpoints.gguf_file import load_gguf
from lever_actors.errors import CheckpointError
from tests.reliability.tiny import assert_consistent, gguf_metadata, gguf_tensors, write_gguf

KV = "qwen2.attention.head_count_kv"


def _expect_error(path: Path, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as err:
        load_gguf(path, torch.float64)
    for fragment in (str(path), *fragments):
        assert fragment in str(err.value)


def test_the_unchanged_file_loads(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "ok.gguf", gguf_metadata(), gguf_tensors())
    checkpoint = load_gguf(path, torch.float64)
    assert_consistent(checkpoint)
    assert checkpoint.tokenizer is not None


@pytest.mark.parametrize(
    ("key", "value", "kind", "fragments"),
    [
        # 1 divides 4, so only the tensors' shapes show that k/v have two heads
        (KV, 1, V.UINT32, ["'blk.0.attn_k.weight' has shape (8, 16)", "implies (4, 16)"]),
        (KV, 3, V.UINT32, [f"{KV} = 3 does not divide qwen2.attention.head_count = 4"]),
        ("qwen2.attention.head_count", 0, V.UINT32, ["head_count = 0 is not positive"]),
        ("qwen2.embedding_length", 0, V.UINT32, ["embedding_length = 0 is not positive"]),
        ("qwen2.attention.key_length", 3, V.UINT32, ["key_length = 3 is odd"]),
        ("qwen2.feed_forward_length", 25, V.UINT32, ["'blk.0.ffn_gate.weight' has shape (24"]),
        (
            "qwen2.attention.layer_norm_rms_epsilon",
            float("nan"),
            V.FLOAT32,
            ["layer_norm_rms_epsilon = nan is not in (0, 1.0)"],
        ),
        ("qwen2.rope.freq_base", float("-inf"), V.FLOAT64, ["freq_base = -inf is not finite"]),
        (
            "qwen2.block_count",
            1,
            V.UINT32,
            ["block_count = 1, but the file holds tensors of layer 1"],
        ),
        ("qwen2.block_count", 3, V.UINT32, ["lacks tensor 'blk.2.attn_norm.weight'"]),
        ("qwen2.block_count", "2", V.STRING, ["'qwen2.block_count' is unreadable as int"]),
        ("qwen2.block_count", b"\xff\xfe", V.STRING, ["'qwen2.block_count' is unreadable"]),
        ("general.architecture", 7, V.UINT32, ["'general.architecture' is unreadable as str"]),
        ("tokenizer.ggml.tokens", [1, 2], V.ARRAY, ["2 tokens but 27 token types"]),
        ("tokenizer.ggml.eos_token_id", "x", V.STRING, ["special token id 'x' is not one of"]),
        ("tokenizer.ggml.eos_token_id", 27, V.UINT32, ["special token id 27 is not one of the 27"]),
    ],
)
def test_bad_metadata_names_the_field(tmp_path, key, value, kind, fragments) -> None:
    metadata = gguf_metadata()
    sub_type = V.INT32 if kind == V.ARRAY else None
    metadata[key] = (value, kind, sub_type)
    path = write_gguf(tmp_path / "bad.gguf", metadata, gguf_tensors())
    _expect_error(path, *fragments)


def test_missing_metadata_names_the_key(tmp_path: Path) -> None:
    metadata = gguf_metadata()
    del metadata["qwen2.embedding_length"]
    path = write_gguf(tmp_path / "bad.gguf", metadata, gguf_tensors())
    _expect_error(path, "lacks 'qwen2.embedding_length'")


def test_a_tensor_of_the_wrong_shape_is_named_with_both_shapes(tmp_path: Path) -> None:
    tensors = gguf_tensors()
    tensors["blk.1.attn_v.bias"] = tensors["blk.1.attn_v.bias"][:6]
    path = write_gguf(tmp_path / "bad.gguf", gguf_metadata(), tensors)
    _expect_error(path, "tensor 'blk.1.attn_v.bias' has shape (6,)", "implies (8,)")


def test_an_embedding_that_is_not_a_matrix(tmp_path: Path) -> None:
    tensors = gguf_tensors()
    tensors["token_embd.weight"] = tensors["token_embd.weight"].reshape(-1)
    path = write_gguf(tmp_path / "bad.gguf", gguf_metadata(), tensors)
    _expect_error(path, "'token_embd.weight' has shape (512,), not 2-D")
