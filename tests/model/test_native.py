"""Our kernels (AMX or AVX2, whichever this CPU has): they compute what the stored format
means, each row on its own, and quantized matrices they do not fit stay on torch's kernels.
On a CPU with neither the kernel tests cannot run; the fallback tests run everywhere (the
built library's cache: test_native_build.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lever_actors.checkpoints.quantize import quantize_q4k, quantize_q6k
from lever_actors.model import native, native_build, row_blocks
from lever_actors.model.formats import GROUP
from lever_actors.model.quantized import quantize_int4, quantize_int8, torch_packing, unpack_int4
from lever_actors.model.weights import ModelWeights

needs_native = pytest.mark.skipif(native.loaded() is None, reason="this CPU cannot run our kernels")


def weight(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05


def rounded_as_int8(x: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """x [m, k] as the integer kernels multiply it, in float64: each `group` inputs rounded
    to int8 at 127 / max |x| (half to even) with a float32 scale."""
    groups = x.float().view(x.shape[0], -1, group)
    top = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, torch.full_like(top, 127.0) / top, 0.0)  # float32, as in C++
    rounded = (groups * inverse).round()
    return (rounded.double() * (top / 127.0).double()).view_as(x)


def as_kernels_see(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] as our int4 and int8 kernels multiply it, in float64: on AVX2 (and its
    AVX512-VNNI build) rounded to int8 per 32 inputs; on AMX x itself."""
    return rounded_as_int8(x) if native.loaded().stem == "avx2" else x.double()


def int4_meaning(x: torch.Tensor, q) -> torch.Tensor:
    """What the int4 kernel computes, in float64: sum over groups of scale * (x . (q - 8))
    plus zero * sum(x), from the stored scales and the packed values read back."""
    out, inputs = q.shape
    scales = q.scales.double()  # [groups, out, 2]
    centred = unpack_int4(q.data).double().view(out, inputs // GROUP, GROUP) - 8
    seen = as_kernels_see(x).view(-1, inputs // GROUP, GROUP)
    per_group = torch.einsum("ngi,mgi->mng", centred, seen)
    return (per_group * scales[..., 0].T).sum(-1) + seen.sum(-1) @ scales[..., 1]


def int8_meaning(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What the int8 kernel computes, in float64: the row's scale times x . q."""
    return (as_kernels_see(x) @ data.double().T) * scales.double()


@needs_native
@pytest.mark.parametrize("shape", [(64, 32), (128, 96), (192, 320)])
def test_int4_computes_the_grouped_sums(shape):
    q = quantize_int4(weight(shape))
    x = torch.randn(5, shape[1]).to(torch.bfloat16)
    expected = int4_meaning(x, q)
    got = native.int4_linear(x, q.data, q.scales).double()
    assert ((got - expected).abs() <= 0.01 * expected.abs() + 1e-3).all()


@needs_native
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_rows_round_as_their_own_groups_say(fmt):
    # a group of zeros, one with a single large input, one spread evenly: each group's
    # scale is its own, so the large input costs its neighbours' groups nothing
    x = torch.zeros(1, 96)
    x[0, 32], x[0, 33] = 1000.0, 0.5
    x[0, 64:] = torch.linspace(-1, 1, 32)
    x = x.to(torch.bfloat16)
    if fmt == "int4":
        q = quantize_int4(weight((64, 96)))
        expected, got = int4_meaning(x, q), native.int4_linear(x, q.data, q.scales)
    else:
        q = quantize_int8(weight((64, 96)))
        expected = int8_meaning(x, q.data, q.scales)
        got = native.int8_linear(x, q.data, q.scales)
    assert ((got.double() - expected).abs() <= 0.01 * expected.abs() + 1e-3).all()


@needs_native
def test_int8_weights_of_minus_128_multiply_right():
    # GGUF's Q8_0 may hold -128; its magnitude only fits a byte unsigned
    q = quantize_int8(weight((64, 64)))
    data = q.data.clone()
    data[:, ::3] = -128
    x = torch.randn(2, 64).to(torch.bfloat16)
    expected = int8_meaning(x, data, q.scales)
    got = native.int8_linear(x, data, q.scales).double()
    assert ((got - expected).abs() <= 0.01 * expected.abs() + 1e-3).all()


@needs_native
@pytest.mark.parametrize("shape", [(64, 32), (128, 96), (192, 320)])
def test_int8_computes_scale_times_the_integer_product(shape):
    q = quantize_int8(weight(shape))
    x = torch.randn(5, shape[1]).to(torch.bfloat16)
    expected = int8_meaning(x, q.data, q.scales)
    got = native.int8_linear(x, q.data, q.scales).double()
    assert ((got - expected).abs() <= 0.01 * expected.abs() + 1e-3).all()


@needs_native
@pytest.mark.parametrize("fmt", ["int4", "int8", "q4k", "q6k"])
def test_a_bias_adds_in_the_products_call_as_torchs_bf16_add_rounds(fmt):
    quantize = {"int4": quantize_int4, "int8": quantize_int8, "q4k": quantize_q4k}
    q = quantize.get(fmt, quantize_q6k)(weight((128, 512)))
    x = torch.randn(3, 512).to(torch.bfloat16)
    bias = torch.randn(128).to(torch.bfloat16)
    assert torch.equal(q.linear(x, bias), q.linear(x) + bias)
    with pytest.raises(RuntimeError, match="bias: \\[n\\] bf16"):
        q.linear(x, bias[:64])


@needs_native
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_row_is_the_same_in_calls_of_every_size(fmt):
    shape = (128, 1088)  # AMX int8: 34 tile depths, converted in two chunks
    q = quantize_int4(weight(shape)) if fmt == "int4" else quantize_int8(weight(shape))
    kernel = native.int4_linear if fmt == "int4" else native.int8_linear
    x = (torch.randn(100, shape[1]) * torch.logspace(-2, 2, shape[1])).to(torch.bfloat16)
    alone = torch.cat([kernel(x[i : i + 1], q.data, q.scales) for i in range(100)])
    # AMX: partial and whole tiles of 16 rows; AVX2: int4 rows in pairs and a lone last one,
    # int8 in fours and what is left; past the 64 that row blocks would have allowed
    for n in (2, 15, 16, 17, 33, 64, 65, 100):
        assert torch.equal(kernel(x[:n], q.data, q.scales), alone[:n]), n


@needs_native
def test_matrices_that_fit_run_on_ours(monkeypatch):
    monkeypatch.setattr(native, "in_use", native.loaded)  # whatever LEVER_ACTORS_KERNELS says
    q = quantize_int4(weight((128, 96)))
    x = torch.randn(3, 96).to(torch.bfloat16)
    assert native.fits("int4", q.shape)
    assert torch.equal(q.linear(x), native.int4_linear(x, q.data, q.scales))


@needs_native
def test_a_drafts_matrices_take_the_faster_kernel_for_their_rows(monkeypatch):
    monkeypatch.setattr(native, "in_use", native.loaded)
    monkeypatch.setattr(native, "fewest_rows", lambda fmt: 8)  # as on AMX
    q = replace(quantize_int4(weight((128, 96))), exact=False)
    few = torch.randn(7, 96).to(torch.bfloat16)
    many = torch.randn(8, 96).to(torch.bfloat16)
    on_torch = torch.ops.aten._weight_int4pack_mm_for_cpu(few, torch_packing(q), GROUP, q.scales)
    assert torch.equal(q.linear(few), on_torch)
    assert torch.equal(q.linear(many), native.int4_linear(many, q.data, q.scales))


def test_drafting_weights_free_only_the_quantized_matrices():
    q, dense = quantize_int8(weight((64, 32))), weight((64, 32))
    weights = ModelWeights(dense, torch.ones(32), dense, [{"wq": q, "wk": dense}])
    drafting = weights.for_drafting()
    assert drafting.layers[0]["wq"].exact is False and q.exact is True
    assert drafting.layers[0]["wq"].data is q.data
    assert drafting.layers[0]["wk"] is dense and drafting.lm_head is drafting.embed


def test_matrices_ours_do_not_fit_stay_on_torch(monkeypatch):
    monkeypatch.setattr(native, "in_use", lambda: native_build.AVX2)  # even where ours are in use
    assert not native.fits("int4", (48, 96))  # outputs not in blocks of 64
    assert not native.fits("int8", (64, 48))  # inputs not in steps of 32
    assert not native.fits("dense", (64, 64))
    q = quantize_int4(weight((48, 96)))
    x = torch.randn(3, 96).to(torch.bfloat16)
    expected = torch.ops.aten._weight_int4pack_mm_for_cpu(x, torch_packing(q), GROUP, q.scales)
    assert torch.equal(q.linear(x), expected)


def test_row_blocks_probe_torchs_kernel_where_only_the_probe_fits_ours(monkeypatch):
    monkeypatch.setattr(native, "in_use", lambda: native_build.AVX2)  # even where ours are in use

    def ours(*args):
        raise AssertionError("the probe ran on our kernels")

    monkeypatch.setattr(native, "int4_linear", ours)
    shape = (1040, 96)  # 1040 outputs: not in blocks of 64; the probe takes 1024 of them
    assert not native.fits("int4", shape)
    assert native.fits("int4", (row_blocks.probe_features(*shape), shape[1]))
    q = quantize_int4(weight(shape))
    x = torch.randn(3, 96).to(torch.bfloat16)
    padded = torch.stack((x, torch.zeros_like(x)), dim=1)  # each row alone, padded to two
    on_torch = [
        torch.ops.aten._weight_int4pack_mm_for_cpu(p, torch_packing(q), GROUP, q.scales)
        for p in padded
    ]
    assert torch.equal(q.linear(x), torch.cat([rows[:1] for rows in on_torch]))


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("torch", native.Kernels.TORCH),
        ("native", native.Kernels.NATIVE),
        ("fast", native.Kernels.NATIVE),
    ],
)
def test_the_kernels_a_user_asks_for(monkeypatch, value, kind):
    monkeypatch.setenv("LEVER_ACTORS_KERNELS", value)
    assert native.requested() is kind


def test_ours_unless_torchs_kernels_are_asked_for(monkeypatch):
    monkeypatch.delenv("LEVER_ACTORS_KERNELS", raising=False)
    assert native.requested() is native.Kernels.NATIVE
