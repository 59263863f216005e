"""load_gguf on tiny GGUF files written with gguf.GGUFWriter: values, metadata, errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lever_actors.checkpoints.gguf_file import load_gguf
from lever_actors.errors import CheckpointError
from lever_actors.model.args import ModelArgs, RopeScaling

# Rows of 256 so every tensor type, K-quants included, fits a whole number of blocks.
D_MODEL, N_HEADS, N_KV_HEADS, HEAD_DIM, FFN, VOCAB, N_LAYERS = 256, 4, 2, 32, 512, 40, 2

# GGUF name (within a layer) -> storage type; the rest of the layer is F32.
LAYER_TYPES = {
    "attn_q.weight": Q.Q8_0,
    "attn_k.weight": Q.Q5_0,
    "attn_v.weight": Q.BF16,
    "attn_output.weight": Q.F16,
    "ffn_gate.weight": Q.Q4_K,
    "ffn_up.weight": Q.Q6_K,
    "ffn_down.weight": Q.F32,
}
OURS = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
}


def _shapes(arch: str) -> dict[str, tuple[int, ...]]:
    """Torch-order shapes ([out, in]) of one layer's GGUF tensors."""
    q, kv = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    shapes = {
        "attn_norm.weight": (D_MODEL,),
        "attn_q.weight": (q, D_MODEL),
        "attn_k.weight": (kv, D_MODEL),
        "attn_v.weight": (kv, D_MODEL),
        "attn_output.weight": (D_MODEL, q),
        "ffn_norm.weight": (D_MODEL,),
        "ffn_gate.weight": (FFN, D_MODEL),
        "ffn_up.weight": (FFN, D_MODEL),
        "ffn_down.weight": (D_MODEL, FFN),
    }
    if arch == "qwen2":
        shapes |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if arch == "qwen3":
        shapes |= {"attn_q_norm.weight": (HEAD_DIM,), "attn_k_norm.weight": (HEAD_DIM,)}
    return shapes


def _random_k_quant(rng: np.random.Generator, shape: tuple[int, int], kind: Q) -> np.ndarray:
    """Random K-quant bytes with finite f16 scales (gguf can dequantize but not quantize these)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block_size, type_size), dtype=np.uint8)
    scale_at = [0, 2] if kind == Q.Q4_K else [208]  # byte offsets of the f16 d (and dmin)
    for at in scale_at:
        scale = rng.uniform(0.001, 0.01, (*raw.shape[:2], 1)).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8)
    return raw.reshape(shape[0], -1)


def _stored(
    rng: np.random.Generator, shape: tuple[int, ...], kind: Q
) -> tuple[np.ndarray, np.ndarray]:
    """(array for GGUFWriter.add_tensor, the float64 values a correct loader must return)."""
    if kind in (Q.Q4_K, Q.Q6_K):
        data = _random_k_quant(rng, shape, kind)  # type: ignore[arg-type]
    else:
        data = gguf.quants.quantize(rng.normal(0, 0.5, shape).astype(np.float32), kind)
    expected = gguf.quants.dequantize(data, kind).astype(np.float64).reshape(shape)
    return data, expected


def write_gguf(
    path: Path,
    arch: str = "qwen2",
    *,
    tied: bool = False,
    layer_types: dict[str, Q] | None = None,
    rope_scaling: float | None = None,
    exact: dict[str, np.ndarray] | None = None,
    tokens: list[str] | None = None,
) -> dict[str, np.ndarray]:
    """A tiny random model; returns the float64 values load_gguf must give, by GGUF name.

    `exact` tensors are stored as given (F32). For llama, the values returned for q/k are the
    stored rows put back in HF order, undoing llama.cpp's converter permutation.
    """
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(N_LAYERS)
    writer.add_context_length(4096)
    writer.add_embedding_length(D_MODEL)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scaling)
    if tokens is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
        writer.add_eos_token_id(len(tokens) - 1)
    types = LAYER_TYPES | (layer_types or {})
    named = {
        "token_embd.weight": ((VOCAB, D_MODEL), Q.F16),
        "output_norm.weight": ((D_MODEL,), Q.F32),
    }
    if not tied:
        named["output.weight"] = ((VOCAB, D_MODEL), Q.Q8_0)
    for i in range(N_LAYERS):
        named |= {f"blk.{i}.{k}": (s, types.get(k, Q.F32)) for k, s in _shapes(arch).items()}
    expected = {}
    for name, (shape, kind) in named.items():
        if exact and name in exact:
            data = exact[name].astype(np.float32)
            values = data.astype(np.float64)
        else:
            data, values = _stored(rng, shape, kind)
        writer.add_tensor(name, data, raw_dtype=kind if data.dtype == np.uint8 else None)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            values = _hf_row_order(values, N_HEADS if "attn_q" in name else N_KV_HEADS)
        expected[name] = values
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf does to llama q/k: per head, rows (2, half) -> (half, 2).
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def _hf_row_order(stored: np.ndarray, n_heads: int) -> np.ndarray:
    # The permutation put HF row order[r] at row r; put every row back where it came from.
    order = _llama_cpp_permute(np.arange(stored.shape[0])[:, None], n_heads)[:, 0]
    hf = np.empty_like(stored)
    hf[order] = stored
    return hf


def _assert_matches(layer: dict[str, torch.Tensor], expected: dict[str, np.ndarray], i: int):
    for gguf_name, ours in OURS.items():
        name = f"blk.{i}.{gguf_name}"
        if name in expected:
            assert layer[ours].dtype == torch.float64
            assert torch.equal(layer[ours], torch.from_numpy(expected[name])), name
        else:
            assert ours not in layer


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_values_load_exactly(tmp_path: Path, arch: str) -> None:
    path = tmp_path / "tiny.gguf"
    expected = write_gguf(path, arch)
    ckpt = load_gguf(path, torch.float64)
    w = ckpt.weights
    assert torch.equal(w.embed, torch.from_numpy(expected["token_embd.weight"]))
    assert torch.equal(w.final_norm, torch.from_numpy(expected["output_norm.weight"]))
    assert torch.equal(w.lm_head, torch.from_numpy(expected["output.weight"]))
    assert len(w.layers) == N_LAYERS
    for i, layer in enumerate(w.layers):
        _assert_matches(layer, expected, i)
    assert ckpt.tokenizer is None
    assert ckpt.source == path


def test_llama_permutation_undone(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    hf_q = rng.normal(size=(N_HEADS * HEAD_DIM, D_MODEL)).astype(np.float32)
    hf_k = rng.normal(size=(N_KV_HEADS * HEAD_DIM, D_MODEL)).astype(np.float32)
    stored = {
        "blk.0.attn_q.weight": _llama_cpp_permute(hf_q, N_HEADS),
        "blk.0.attn_k.weight": _llama_cpp_permute(hf_k, N_KV_HEADS),
    }
    path = tmp_path / "llama.gguf"
    write_gguf(path, "llama", exact=stored)
    layer = load_gguf(path, torch.float64).weights.layers[0]
    assert torch.equal(layer["wq"], torch.from_numpy(hf_q).double())
    assert torch.equal(layer["wk"], torch.from_numpy(hf_k).double())
    # Qwen2 is not permuted: the same rows come back as stored.
    write_gguf(path, "qwen2", exact=stored)
    layer = load_gguf(path, torch.float64).weights.layers[0]
    assert torch.equal(layer["wq"], torch.from_numpy(stored["blk.0.attn_q.weight"]).double())


def test_metadata_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "qwen3.gguf"
    write_gguf(path, "qwen3", tied=True, rope_scaling=4.0)
    ckpt = load_gguf(path, torch.float32)
    # every field spelt out, not TINY_ARGS: what the file's metadata says is the point
    assert ckpt.args == ModelArgs(
        arch="qwen3",
        vocab_size=VOCAB,
        d_model=D_MODEL,
        n_layers=N_LAYERS,
        n_heads=N_HEADS,
        n_kv_heads=N_KV_HEADS,
        head_dim=HEAD_DIM,
        ffn_dim=FFN,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_seq_len=4096,
        tie_embeddings=True,
        rope_scaling=RopeScaling(kind="linear", factor=4.0),
    )
    assert ckpt.weights.lm_head is ckpt.weights.embed
    assert ckpt.weights.embed.dtype == torch.float32


def _expect_error(path: Path, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as err:
        load_gguf(path, torch.float32)
    for fragment in (str(path), *fragments):
        assert fragment in str(err.value)


@pytest.mark.parametrize(
    ("cut_to", "cause"),
    [
        (lambda n: 20, "cannot read GGUF file (20 bytes; truncated"),  # inside the header
        (lambda n: n // 2, "runs past the end of the file (truncated?)"),
        (lambda n: n - 64, "tensor 'blk.1.attn_v.bias' runs past the end"),  # the last tensor
    ],
)
def test_truncated_file(tmp_path: Path, cut_to: Callable[[int], int], cause: str) -> None:
    path = tmp_path / "cut.gguf"
    write_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[: cut_to(len(data))])
    _expect_error(path, cause)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    path = tmp_path / "int.gguf"
    writer_types = {"attn_q.weight": Q.F32}
    write_gguf(path, layer_types=writer_types)
    # Swap blk.0.attn_q.weight's type id (F32 = 0) for I32 = 26 in the tensor-info table.
    _patch_type(path, "blk.0.attn_q.weight", int(Q.I32))
    _expect_error(path, "'blk.0.attn_q.weight'", "I32")


def test_unknown_tensor_type_id(tmp_path: Path) -> None:
    path = tmp_path / "unknown.gguf"
    write_gguf(path)
    _patch_type(path, "blk.1.ffn_down.weight", 250)
    _expect_error(path, "'blk.1.ffn_down.weight'", "250")


def _patch_type(path: Path, name: str, type_id: int) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(name.encode() + b"\x02\x00\x00\x00")  # name, then n_dims=2 (u32)
    at += len(name) + 4 + 2 * 8  # skip name, n_dims and two u64 dims
    data[at : at + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(path, "gemma")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _expect_error(path, "'gemma'", "supported: llama, qwen2, qwen3, gemma2, phi3")


def test_missing_file(tmp_path: Path) -> None:
    _expect_error(tmp_path / "absent.gguf", "no such GGUF file")


def test_tokenizer_loaded_with_model(tmp_path: Path) -> None:
    path = tmp_path / "with_vocab.gguf"
    byte_tokens = [chr(c) for c in range(33, 127)]  # printable ASCII spells itself byte-level
    write_gguf(path, tokens=byte_tokens + ["<|im_end|>"])
    tokenizer = load_gguf(path, torch.float32).tokenizer
    assert tokenizer is not None
    end = len(byte_tokens)
    assert tokenizer.encode("ab<|im_end|>") == [byte_tokens.index("a"), byte_tokens.index("b"), end]
    assert tokenizer.eos_ids == {end}
