"""--isolate: each mode in a child process, under a cgroup memory limit where the machine
has one; peak RSS per mode either way; a child killed by its limit is a failed row."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from lever_actors.bench import plan
from lever_actors.bench import run as bench_run
from lever_actors.bench.child import ChildMode
from lever_actors.bench.isolation import (
    MemoryCgroup,
    evict_from_page_cache,
    evict_ranges,
    probe_cgroup,
)
from lever_actors.bench.opening import open_in_process
from lever_actors.bench.plan import BenchOptions, plan_modes
from lever_actors.bench.report import limits_lines, memory_note
from lever_actors.bench.run import bench
from lever_actors.device.manifest import read_manifest
from lever_actors.draft import load_draft
from lever_actors.errors import ConfigError
from lever_actors.model import native
from lever_actors.threads import PIPELINE_ONLY

SUPPORT = probe_cgroup()


def _options(tmp_path: Path, **fields) -> BenchOptions:
    fields = {"isolate": "all", **fields}
    return BenchOptions(
        budgets=("50%",),
        draft_dtype="float32",
        prompt_sets=("humaneval",),
        prompts=1,
        max_new_tokens=4,
        cache_dir=str(tmp_path / "cache"),
        **fields,
    )


def _leftover_cgroups() -> list[str]:
    if SUPPORT.base is None:
        return []
    return [
        p.name for p in SUPPORT.base.iterdir() if p.name.startswith(f"lever-bench-{os.getpid()}-")
    ]


def test_each_mode_in_its_own_limited_child(one_set, tmp_path):
    options = _options(tmp_path, modes=("flash-ar", "lever", "peer-offload"), order="sequential")
    results = bench(options, one_set)
    assert [m.name for m in results.modes] == ["flash-ar@50%", "lever@50%", "peer-offload@50%"]
    for info in results.modes:
        assert info.isolated
        assert info.limit_enforced == SUPPORT.usable
        # default limit: the budget + the draft's weights + 1 GiB, as the kernel rounds it
        assert info.memory_limit_bytes == pytest.approx(
            info.budget_bytes + os.path.getsize(one_set.draft / "model.safetensors") // 2 + 2**30,
            abs=8192,
        )
    for s in results.summaries:
        assert s.failed is None, s.failed
        assert s.peak_rss_bytes and s.peak_rss_bytes > 50 * 2**20  # a child with torch loaded
        if SUPPORT.usable:
            assert (
                s.cgroup_peak_bytes
                and s.cgroup_peak_bytes < results.info(s.mode).memory_limit_bytes
            )
    assert _leftover_cgroups() == []
    assert "accelerate placed" in results.info("peer-offload@50%").note  # sent by the child
    note = "kernel-enforced" if SUPPORT.usable else "No memory limit was enforced"
    assert note in memory_note(results)


def test_our_kernels_are_built_before_any_child_goes_under_a_limit(one_set, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(native, "in_use", lambda: calls.append("built"))
    monkeypatch.setattr(bench_run, "ChildMode", lambda p, cgroups: calls.append(p.info.name))
    options = _options(tmp_path, modes=("flash-ar", "lever"), order="sequential")
    planned = plan_modes(options, one_set.target, one_set.draft)
    bench_run.make_modes(planned, None, {})
    assert calls == ["built", "flash-ar@50%", "lever@50%"]


def test_isolating_the_peers_only_runs_ours_interleaved_beside_them(one_set, tmp_path):
    options = _options(
        tmp_path, modes=("flash-ar", "lever", "peer-offload"), isolate="peers", order="interleaved"
    )
    results = bench(options, one_set)
    isolated = {info.name: info.isolated for info in results.modes}
    assert isolated == {"flash-ar@50%": False, "lever@50%": False, "peer-offload@50%": True}
    assert results.info("flash-ar@50%").memory_limit_bytes is None
    assert results.info("peer-offload@50%").limit_enforced == SUPPORT.usable
    for s in results.summaries:
        assert s.failed is None, s.failed
    assert _leftover_cgroups() == []
    assert "page cache): flash-ar@50%, lever@50%." in memory_note(results)


@pytest.mark.skipif(not SUPPORT.usable, reason=f"no cgroup memory limits: {SUPPORT.reason}")
def test_a_child_over_its_limit_is_a_failed_row(one_set, tmp_path):
    options = _options(tmp_path, modes=("flash-ar",), memory_limit="40MiB")
    results = bench(options, one_set)
    (summary,) = results.summaries
    assert summary.failed and "killed by the memory limit of 40.0 MiB" in summary.failed
    assert results.info("flash-ar@50%").limit_enforced
    assert _leftover_cgroups() == []


@pytest.mark.skipif(not SUPPORT.usable, reason=f"no cgroup memory limits: {SUPPORT.reason}")
def test_cgroup_limit_and_peak():
    cgroup = MemoryCgroup(SUPPORT, f"lever-bench-{os.getpid()}-unit", 123_456_789)
    try:
        assert abs(cgroup.limit_bytes - 123_456_789) < 4096
        assert cgroup.peak_bytes() == 0 and cgroup.oom_kills() == 0
    finally:
        cgroup.remove()
    assert not cgroup.path.exists()


def test_probe_reads_v1_and_v2_layouts(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("0::/\n")
    (proc / "mountinfo").write_text(
        "41 31 0:38 / /nonexistent/unified rw,relatime - cgroup2 cgroup2 rw\n"
    )
    support = probe_cgroup(proc)
    if os.geteuid() == 0:
        assert not support.usable and "v2" in support.reason


def _resident_pages(mapped: mmap.mmap, size: int) -> int:
    """Pages of a mapping that are in DRAM (mincore)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    page = mmap.PAGESIZE
    vec = (ctypes.c_ubyte * (size // page))()
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0
    return sum(v & 1 for v in vec)


def test_eviction_drops_pages_even_where_this_process_maps_them(tmp_path):
    size = 1 << 20
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(size))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        # private and writable but never written, as safetensors maps its files
        mapped = mmap.mmap(
            f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    try:
        assert sum(mapped[i] for i in range(0, size, mmap.PAGESIZE)) >= 0  # touch every page
        assert _resident_pages(mapped, size) == size // mmap.PAGESIZE
        assert evict_from_page_cache([tmp_path]) == size
        assert _resident_pages(mapped, size) == 0
        evict_ranges({path: [(0, size // 2)]})  # a range: only the first half goes
        assert sum(mapped[i] for i in range(0, size, mmap.PAGESIZE)) >= 0
        evict_ranges({path: [(0, size // 2)]})
        assert _resident_pages(mapped, size) == size // mmap.PAGESIZE // 2
    finally:
        mapped.close()


def test_limits_axis_runs_ours_with_the_budget_and_plan_they_choose(one_set, tmp_path):
    layout = read_manifest(one_set.target).file_bytes
    options = _options(
        tmp_path,
        modes=("memory-ar", "flash-ar", "lever"),
        limits=("1GiB", "2GiB"),
        order="sequential",
    )
    results = bench(options, one_set)
    infos = {m.name: m for m in results.modes}
    assert list(infos) == [
        "memory-ar",
        "flash-ar@1GiB",
        "lever@1GiB",
        "flash-ar@2GiB",
        "lever@2GiB",
    ]
    assert infos["memory-ar"].memory_limit_bytes is None and infos["memory-ar"].limit is None
    assert infos["memory-ar"].plan is None and infos["memory-ar"].idle_anon_rss_bytes  # its child's
    for name in ("flash-ar@1GiB", "lever@1GiB", "flash-ar@2GiB", "lever@2GiB"):
        info = infos[name]
        # the engine planned its budget in the child: the tiny target fits whole
        assert info.budget == "auto" and info.budget_bytes == layout
        assert info.plan in ("trees", "lookup", "ar")
        assert info.idle_anon_rss_bytes and info.idle_anon_rss_bytes > 50 * 2**20  # torch
        assert info.idle_file_rss_bytes and info.idle_file_rss_bytes > 0
    assert infos["lever@1GiB"].plan_auto and not infos["flash-ar@1GiB"].plan_auto
    assert infos["flash-ar@1GiB"].plan == "ar"
    for name in ("flash-ar@1GiB", "lever@1GiB"):
        assert infos[name].limit == "1GiB" and infos[name].isolated
        assert infos[name].memory_limit_bytes == pytest.approx(2**30, abs=8192)
    summary = results.summary
    assert summary.limit == "1GiB" and summary.layout_bytes == layout
    assert summary.gguf_bytes is None  # the tiny target came from an HF directory
    assert summary.min_agreement == 1.0
    for limit in ("1GiB", "2GiB"):
        figures = summary.limits[limit]
        for key, mode in (("lever", "lever"), ("flash_ar", "flash-ar")):
            runs = [r for r in results.runs if r.mode == f"{mode}@{limit}"]
            expected = sum(r.decode_tokens for r in runs) / sum(r.decode_s for r in runs)
            assert getattr(figures, key) == pytest.approx(expected)
        assert set(figures.peak_rss_gib) == {f"flash-ar@{limit}", f"lever@{limit}"}
        assert figures.best_sd is None and figures.llamacpp_best is None
        assert figures.plan == infos[f"lever@{limit}"].plan
        assert figures.peak_gib == max(
            figures.peak_rss_gib[f"lever@{limit}"],
            figures.cgroup_peak_gib.get(f"lever@{limit}", 0.0),
        )
    assert summary.memory_ar_quantized is not None and summary.memory_ar_bf16 is None
    assert summary.lever_over_memory_ar_3gib is None  # no 3 GiB limit in this run
    lever = infos["lever@2GiB"]  # the largest limit's
    assert summary.idle_rss_mib == {
        "anon": lever.idle_anon_rss_bytes / 2**20,
        "file": lever.idle_file_rss_bytes / 2**20,
    }
    table = limits_lines(results)
    for limit in ("1GiB", "2GiB"):
        figures = summary.limits[limit]
        ratio = figures.lever / figures.flash_ar
        # no SD nor llama.cpp run: no columns for them
        assert f"| {limit} | {figures.lever:.2f} | {figures.flash_ar:.2f} | {ratio:.2f}x" in table
    assert (
        "memory-ar: in a process of its own, no limit" in memory_note(results) or not SUPPORT.usable
    )


def test_limits_need_every_mode_in_a_child(tmp_path):
    with pytest.raises(ConfigError, match="--limits runs every mode in a child"):
        _options(tmp_path, isolate="peers", limits=("1GiB",))
    with pytest.raises(ConfigError, match="--limits runs every mode in a child"):
        _options(tmp_path, limits=("1GiB",), memory_limit="2GiB")
    with pytest.raises(ConfigError, match="cannot read '1 gigabyte' as a size"):
        _options(tmp_path, limits=("1 gigabyte",))


async def test_children_with_one_openmp_team_spin_and_two_units_keep_their_sleep(
    one_set, tmp_path, monkeypatch
):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # as the launcher sets it for the bench
    monkeypatch.setenv(PIPELINE_ONLY, "OMP_WAIT_POLICY")
    modes = ("memory-ar", "flash-ar", "lever-two-units")
    options = _options(tmp_path, modes=modes, isolate="all")
    planned = plan_modes(options, one_set.target, one_set.draft)
    policies = []
    for mode in planned:
        async with AsyncExitStack() as stack:
            child = ChildMode(mode)
            await child.open(stack)
            environ = Path(f"/proc/{child.process.pid}/environ").read_bytes().split(b"\0")
            policies.append(b"OMP_WAIT_POLICY=PASSIVE" in environ)
    assert [m.info.family for m in planned] == list(modes)
    assert policies == [False, False, True]


def test_a_child_leaves_its_draft_to_the_engines_unit_and_one_process_shares_it(tiny_pair):
    # a draft loaded on the calling thread would start a second OpenMP team (device/units.py)
    target, draft = tiny_pair
    options = BenchOptions(modes=["sd-chain"], chain=[2, 3], draft_dtype="float32")
    planned = plan_modes(options, target, draft)
    assert len(planned) == 2
    assert all(open_in_process(p, drafts=None).draft is None for p in planned)
    drafts: dict = {}
    shared = [open_in_process(p, drafts).draft for p in planned]
    assert shared[0] is not None and shared[0] is shared[1] and len(drafts) == 1


def test_planning_loads_the_draft_only_where_a_memory_limit_needs_its_size(tiny_pair, monkeypatch):
    target, draft = tiny_pair
    loads = []
    monkeypatch.setattr(
        plan, "load_draft", lambda *a, **kw: loads.append(a) or load_draft(*a, **kw)
    )
    in_process = BenchOptions(modes=["sd-chain", "lever"], chain=[2], draft_dtype="float32")
    assert plan_modes(in_process, target, draft) and loads == []
    isolated = BenchOptions(
        modes=["sd-chain", "lever"], chain=[2], draft_dtype="float32", isolate="all"
    )
    modes = plan_modes(isolated, target, draft)
    assert len(loads) == 1  # measured once for every mode that needs it
    assert all(m.info.memory_limit_bytes for m in modes)
