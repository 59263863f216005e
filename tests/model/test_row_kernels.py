"""Our attention, RMS norm and rotary kernels (csrc/attention.h, norm.h, rope.h): each row
computed from its own inputs alone, in one fixed order, so a token gets the same bits in a tree
of any size."""

from __future__ import annotations

import pytest
import torch

from lever_actors.model import layers, native
from lever_actors.model.rope import apply_rope
from lever_actors.testing.checkpoints import TINY_ARGS

needs_native = pytest.mark.skipif(native.loaded() is None, reason="this CPU cannot run our kernels")


def inputs(heads: int, kv: int, n: int, T: int, hd: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, keys, values = (
        torch.randn(*s, generator=g).bfloat16() for s in ((heads, n, hd), (kv, T, hd), (kv, T, hd))
    )
    mask = torch.rand(n, T, generator=g) < 0.7
    mask[:, 0] = True  # every row sees at least one key
    return q, keys, values, mask


def reference(q, keys, values, mask, scale: float, softcap: float | None) -> torch.Tensor:
    """[n, H, hd] in float64, from the definition."""
    heads, kv = q.shape[0], keys.shape[0]
    k = keys.double().repeat_interleave(heads // kv, 0)
    v = values.double().repeat_interleave(heads // kv, 0)
    scores = q.double() @ k.transpose(1, 2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)


@needs_native
@pytest.mark.parametrize(
    "heads,kv,hd", [(2, 2, 8), (6, 1, 16), (12, 2, 128), (14, 2, 64), (16, 2, 32)]
)
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_attend_computes_softmax_attention(heads, kv, hd, softcap):
    q, keys, values, mask = inputs(heads, kv, 5, 37, hd)
    got = native.attend(q, keys, values, mask, hd**-0.5, softcap)
    expected = reference(q, keys, values, mask, hd**-0.5, softcap)
    assert got.shape == (5, heads, hd) and got.dtype == torch.bfloat16
    assert ((got.double() - expected).abs() <= 0.01 * expected.abs() + 2e-3).all()


@needs_native
def test_a_row_sees_only_its_visible_keys_whatever_else_the_call_holds():
    q, keys, values, mask = inputs(12, 2, 40, 300, 128)
    together = native.attend(q, keys, values, mask, 0.1, None)
    for i in (0, 7, 39):
        seen = mask[i].nonzero().squeeze(1)  # the row alone, its visible keys packed, no mask
        alone = native.attend(q[:, i : i + 1], keys[:, seen], values[:, seen], None, 0.1, None)
        assert torch.equal(alone[0], together[i]), i
    chained = native.attend(q, keys, values, torch.ones_like(mask), 0.1, None)  # mask of all: none
    assert torch.equal(chained, native.attend(q, keys, values, None, 0.1, None))


@needs_native
def test_keys_may_be_a_view_into_a_longer_cache():
    q, keys, values, mask = inputs(4, 2, 3, 50, 16)
    cache = torch.zeros(2, 80, 16, dtype=torch.bfloat16)
    cache[:, :50] = keys
    values_cache = torch.zeros_like(cache)
    values_cache[:, :50] = values
    got = native.attend(q, cache[:, :50], values_cache[:, :50], mask, 0.25, None)
    assert torch.equal(got, native.attend(q, keys, values, mask, 0.25, None))


@needs_native
def test_layers_attend_in_bf16_on_ours_and_in_float64_on_torch(monkeypatch):
    q, keys, values, mask = inputs(2, 1, 3, 9, 8)  # TINY_ARGS' heads
    calls = []
    monkeypatch.setattr(native, "in_use", native.loaded)
    monkeypatch.setattr(
        native,
        "attend",
        lambda *a: calls.append(a[0].dtype) or torch.zeros(3, 2, 8, dtype=torch.bfloat16),
    )
    layers.attend(q, keys, values, mask, TINY_ARGS)
    out = layers.attend(q.double(), keys.double(), values.double(), mask, TINY_ARGS)
    assert calls == [torch.bfloat16]
    expected = reference(q, keys, values, mask, 8**-0.5, None).transpose(0, 1)
    assert torch.allclose(out, expected)


@needs_native
def test_attention_ours_does_not_take_stays_on_torch(monkeypatch):
    monkeypatch.setattr(native, "in_use", native.loaded)
    bf16 = torch.bfloat16
    assert native.attends(torch.zeros(12, 1, 128, dtype=bf16), torch.zeros(2, 4, 128, dtype=bf16))
    # 9 query heads per kv head; a head dimension not a multiple of 8; float32
    assert not native.attends(torch.zeros(18, 1, 8, dtype=bf16), torch.zeros(2, 4, 8, dtype=bf16))
    assert not native.attends(torch.zeros(2, 1, 6, dtype=bf16), torch.zeros(2, 4, 6, dtype=bf16))
    assert not native.attends(torch.zeros(2, 1, 8), torch.zeros(2, 4, 8))


@needs_native
@pytest.mark.parametrize("shape", [(1, 1536), (48, 96), (12, 5, 128), (3, 8)])
def test_rms_norm_rounds_as_the_float64_norm(shape):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3).bfloat16()
    weight = (torch.rand(shape[-1], generator=g) + 0.5).bfloat16()
    h = x.double()
    expected = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    got = native.rms_norm(x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert (got == expected).float().mean() > 0.99  # a float32 step may round a tie apart
    assert torch.allclose(got.float(), expected.float(), rtol=1e-2)


@needs_native
def test_rms_norm_gives_a_row_the_same_bits_alone_or_among_others():
    x = (torch.randn(100, 1536) * torch.logspace(-2, 2, 1536)).bfloat16()
    weight = torch.rand(1536).bfloat16()
    together = native.rms_norm(x, weight, 1e-5)
    alone = torch.cat([native.rms_norm(x[i : i + 1], weight, 1e-5) for i in range(100)])
    assert torch.equal(together, alone)


@needs_native
@pytest.mark.parametrize("heads,n,hd", [(14, 1, 64), (2, 5, 64), (12, 33, 128)])
def test_rope_rounds_as_torchs_bf16_ops(heads, n, hd):
    g = torch.Generator().manual_seed(2)
    rows = (torch.randn(n, heads * hd, generator=g) * 3).bfloat16()  # a projection's output
    x = rows.view(n, heads, hd).transpose(0, 1)  # [heads, n, hd], strided as layers view it
    cos, sin = (torch.randn(n, hd, generator=g).bfloat16() for _ in range(2))
    half = hd // 2
    expected = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    got = apply_rope(x, cos, sin)
    assert torch.equal(got, expected) and got.is_contiguous()
