"""The bench's lever-plain mode (bench/plain_mode.py): the plain path in a child of its own
under each memory limit, torch never loaded there, the same tokens as memory-resident AR on
torch; refused, with the reason, where `generate` would not take the plain path."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import torch

from lever_actors.bench.child import ChildMode
from lever_actors.bench.harness import PromptSet, Workload
from lever_actors.bench.mode import ModeFailed
from lever_actors.bench.opening import open_in_process
from lever_actors.bench.plan import BenchOptions, plan_modes
from lever_actors.bench.report import limits_lines
from lever_actors.bench.run import bench
from lever_actors.device.manifest import read_manifest
from lever_actors.model.sampling import GREEDY
from lever_actors.testing import model_pair
from lever_actors.testing.checkpoints import bf16_args
from tests.model.test_native import needs_native

PROMPTS = PromptSet("humaneval", [[3, 14, 15, 92, 65], [2, 71, 82, 81, 82, 84, 59]])


@pytest.fixture(scope="module")
def quantized() -> Workload:
    layout = model_pair(bf16_args(), "identical", dtype=torch.bfloat16, weights="q4k").target
    return Workload(layout, None, [PROMPTS], frozenset())


def _options(tmp_path: Path, **fields) -> BenchOptions:
    return BenchOptions(
        isolate="all",
        prompt_sets=("humaneval",),
        prompts=2,
        max_new_tokens=6,
        cache_dir=str(tmp_path / "cache"),
        **fields,
    )


@needs_native
def test_the_plain_path_decodes_memory_ars_tokens_under_each_limit(quantized, tmp_path):
    options = _options(tmp_path, modes=("memory-ar", "lever-plain"), limits=("1GiB", "2GiB"))
    results = bench(options, quantized)
    infos = {m.name: m for m in results.modes}
    assert list(infos) == ["memory-ar", "lever-plain@1GiB", "lever-plain@2GiB"]
    layout = read_manifest(quantized.target).file_bytes
    for name in ("lever-plain@1GiB", "lever-plain@2GiB"):
        info = infos[name]
        assert info.plan == "ar" and not info.plan_auto and info.isolated
        assert info.budget_bytes is not None and info.budget_bytes >= layout
        assert info.idle_anon_rss_bytes and info.idle_file_rss_bytes
    assert all(r.failed is None for r in results.runs)
    assert results.summary.min_agreement == 1.0  # token for token torch's memory-resident AR
    for limit in ("1GiB", "2GiB"):
        runs = [r for r in results.runs if r.mode == f"lever-plain@{limit}"]
        expected = sum(r.decode_tokens for r in runs) / sum(r.decode_s for r in runs)
        figures = results.summary.limits[limit]
        assert figures.plain == pytest.approx(expected) and figures.lever is None
        assert all(r.bytes_read == 0 and r.steps == r.new_tokens for r in runs)  # all in DRAM
    assert "plain path" in limits_lines(results)


@needs_native
def test_the_plain_paths_copies_decode_memory_ars_tokens(quantized, tmp_path):
    options = _options(tmp_path, modes=("memory-ar", "lever-plain-lookup"), limits=("1GiB",))
    results = bench(options, quantized)
    info = next(m for m in results.modes if m.name == "lever-plain-lookup@1GiB")
    assert info.plan == "lookup" and not info.plan_auto
    assert all(r.failed is None for r in results.runs)
    assert results.summary.min_agreement == 1.0
    runs = [r for r in results.runs if r.mode == info.name]
    assert all(1 <= r.steps <= r.new_tokens for r in runs)


@needs_native
async def test_the_plain_paths_child_never_loads_torch(quantized, tmp_path):
    [planned] = plan_modes(_options(tmp_path, modes=("lever-plain",)), quantized.target, None)
    async with AsyncExitStack() as stack:
        child = ChildMode(planned)
        await child.open(stack)
        assert child.process is not None
        decoded = await child.decode(PROMPTS.prompts[0], 4, frozenset(), GREEDY)
        maps = Path(f"/proc/{child.process.pid}/maps").read_text()
    assert "/kernels/plain-" in maps  # our plain library, loaded by the plain target
    assert "libtorch" not in maps
    assert len(decoded.tokens) == 4


async def test_a_layout_the_plain_path_does_not_run_fails_with_the_reason(tiny_pair, tmp_path):
    target, _ = tiny_pair  # float32
    [planned] = plan_modes(_options(tmp_path, modes=("lever-plain",)), target, None)
    async with AsyncExitStack() as stack:
        with pytest.raises(
            ModeFailed, match="the plain path does not run it: the plain path computes in bf16"
        ):
            await ChildMode(planned).open(stack)


@needs_native
def test_levers_auto_plan_takes_the_plain_path_where_the_draft_cannot_join_the_target(
    quantized, tmp_path
):
    draft = tmp_path / "draft.gguf"  # as big as the limit: never beside the whole target
    with open(draft, "wb") as sparse:
        sparse.truncate(1 << 30)
    workload = Workload(quantized.target, draft, [PROMPTS], frozenset())
    results = bench(_options(tmp_path, modes=("memory-ar", "lever"), limits=("1GiB",)), workload)
    lever = next(m for m in results.modes if m.name == "lever@1GiB")
    assert lever.plan == "lookup" and lever.plan_auto and lever.family == "lever"
    assert all(r.failed is None for r in results.runs)
    assert results.summary.min_agreement == 1.0
    assert results.summary.limits["1GiB"].plan == "lookup"


@needs_native
def test_auto_opens_the_plain_path_wherever_it_holds_the_target(quantized, tiny_pair, tmp_path):
    small = model_pair(bf16_args(), "identical", dtype=torch.bfloat16, weights="q4k").draft
    options = _options(tmp_path, modes=("lever",), limits=("8GiB",))
    [fits] = plan_modes(options, quantized.target, small)  # the draft fits beside it too
    target, draft = tiny_pair  # float32: the plain path computes in bf16
    [float32] = plan_modes(options, target, draft)
    opened = [type(open_in_process(planned, drafts=None)).__name__ for planned in (fits, float32)]
    assert opened == ["PlainMode", "EngineMode"]
