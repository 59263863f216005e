"""Each architecture read from a GGUF file in llama.cpp's naming equals transformers."""

from __future__ import annotations

import pytest
import torch

from lever_actors.checkpoints.gguf_file import load_gguf
from lever_actors.model.sequential import sequential_cached
from lever_actors.model.transformer import Transformer
from tests.hf_to_gguf import write_gguf_of
from tests.tiny_hf import LLAMA3_ROPE, full_precision_norms, their_greedy, tiny_model

CASES = [
    pytest.param("llama", {}, id="llama"),
    pytest.param("llama", {"tie": True}, id="llama-tied-smollm-style"),
    # a Mistral GGUF is a llama one, and llama.cpp's llama keeps no sliding window
    pytest.param("mistral", {"window": None}, id="mistral"),
    pytest.param("qwen2", {}, id="qwen2"),
    pytest.param("qwen3", {}, id="qwen3"),
    # GGUF keeps no query scale: llama.cpp takes head_dim, as Gemma 2 2B and 9B have
    pytest.param("gemma2", {"tie": True, "query_scale": 16}, id="gemma2"),
    pytest.param("phi3", {}, id="phi3-window"),
]


def _logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    return model.logits(model.forward(tokens, model.new_cache(len(tokens))))


def _load(theirs, tmp_path) -> Transformer:
    ours = load_gguf(write_gguf_of(theirs, tmp_path / "model.gguf"), torch.float64)
    return Transformer(ours.args, ours.weights)


@pytest.mark.parametrize(("arch", "kwargs"), CASES)
def test_gguf_equals_transformers(arch, kwargs, tmp_path):
    theirs = tiny_model(arch, **kwargs)
    ours = _load(theirs, tmp_path)
    tokens = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    with full_precision_norms(), torch.no_grad():
        expected = theirs(tokens[None]).logits[0]
    assert (_logits(ours, tokens) - expected).abs().max().item() <= 1e-9
    prompt = [3, 14, 15, 92, 65, 35]
    assert sequential_cached(ours, prompt, 24) == their_greedy(theirs, prompt, 24)


def test_rope_freqs_tensor_is_llama3_scaling(tmp_path):
    """Llama 3.1/3.2 GGUFs carry llama3 RoPE scaling as per-pair frequency divisors (float32),
    which round the frequencies transformers computes by at most one float32 ulp."""
    theirs = tiny_model("llama", rope_scaling=LLAMA3_ROPE)
    ours = _load(theirs, tmp_path)
    assert ours.args.rope_scaling is not None
    assert ours.args.rope_scaling.kind == "freq_factors"
    tokens = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    with full_precision_norms(), torch.no_grad():
        expected = theirs(tokens[None]).logits[0]
        unscaled = tiny_model("llama")(tokens[None]).logits[0]
    error = (_logits(ours, tokens) - expected).abs().max().item()
    assert error <= 1e-5
    assert (unscaled - expected).abs().max().item() > 1e3 * error  # the scaling matters
    prompt = [3, 14, 15, 92, 65, 35]
    assert sequential_cached(ours, prompt, 24) == their_greedy(theirs, prompt, 24)
