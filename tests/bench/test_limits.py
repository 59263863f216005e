"""--limits: how our modes are planned under each limit (the engine's own budget and, for
Lever, its own decode plan), and the summary, report and plot of the memory curve, from
fabricated runs."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import trio
from PIL import Image

from lever_actors.bench import plan, plots
from lever_actors.bench.harness import run_bench
from lever_actors.bench.mode import Decoded
from lever_actors.bench.plan import BenchOptions, plan_modes
from lever_actors.bench.report import limits_lines, output_paths, readme_section
from lever_actors.bench.results import ModeInfo, read_results, write_results
from lever_actors.bench.specs import EngineSpec
from lever_actors.cli.bench import options_from_args
from lever_actors.errors import ConfigError
from tests.bench.fakes import SETS, FakeMode

GIB = 2**30
MIB = 2**20


def test_limits_plan_our_budgets_auto_and_levers_decode_plan_auto(tiny_pair, monkeypatch):
    target, draft = tiny_pair
    monkeypatch.setattr(plan, "load_draft", lambda *a, **kw: pytest.fail("no draft to measure"))
    options = BenchOptions(
        modes=("memory-ar", "flash-ar", "lever", "lever-no-prune", "llamacpp-ar"),
        limits=("1GiB", "3GiB"),
        isolate="all",
        draft_dtype="float32",
    )
    planned = {p.info.name: p for p in plan_modes(options, target, draft)}
    assert list(planned) == [
        "memory-ar",
        "flash-ar@1GiB",
        "lever@1GiB",
        "lever-no-prune@1GiB",
        "llamacpp-ar@1GiB",
        "flash-ar@3GiB",
        "lever@3GiB",
        "lever-no-prune@3GiB",
        "llamacpp-ar@3GiB",
    ]
    for limit in ("1GiB", "3GiB"):
        engines = {
            name: p
            for name, p in planned.items()
            if name.endswith(f"@{limit}") and isinstance(p.spec, EngineSpec)
        }
        assert set(engines) == {f"flash-ar@{limit}", f"lever@{limit}", f"lever-no-prune@{limit}"}
        for name, p in engines.items():
            assert isinstance(p.spec, EngineSpec)
            config = p.spec.config
            assert config.dram_budget.kind == "auto"
            # the budget is the engine's to plan: the child reports it once open
            assert p.info.budget == "auto" and p.info.budget_bytes is None
            assert p.info.memory_limit_bytes == pytest.approx(float(limit[0]) * GIB)
            assert config.plan == ("auto" if name.startswith("lever@") else None)
        lever = engines[f"lever@{limit}"].spec
        assert isinstance(lever, EngineSpec) and lever.config.draft == str(draft)
        flash = engines[f"flash-ar@{limit}"].spec
        assert isinstance(flash, EngineSpec) and flash.config.draft is None


def test_forced_plans_run_under_each_limit_with_their_plan_and_only_trees_draft(tiny_pair):
    target, draft = tiny_pair
    options = BenchOptions(
        modes=("lever-trees", "lever-lookup", "lever-ar"), limits=("1GiB",), isolate="all"
    )
    planned = {p.info.name: p.spec for p in plan_modes(options, target, draft)}
    configs = {name: spec.config for name, spec in planned.items()}  # type: ignore[union-attr]
    assert {name: (c.plan, c.draft) for name, c in configs.items()} == {
        "lever-trees@1GiB": ("trees", str(draft)),
        "lever-lookup@1GiB": ("lookup", None),
        "lever-ar@1GiB": ("ar", None),
    }
    with pytest.raises(ConfigError, match="speculative modes need a draft model"):
        plan_modes(options, target, None)
    no_draft = BenchOptions(modes=("lever-lookup", "lever-ar"), limits=("1GiB",), isolate="all")
    assert len(plan_modes(no_draft, target, None)) == 2


def test_limits_from_the_command_line_run_every_mode_in_a_child(bench_parser):
    options = options_from_args(bench_parser.parse_args(["--limits", "0.75GiB,3GiB"]))
    assert options.limits == ("0.75GiB", "3GiB")
    # each limit's modes take turns on every prompt (bench/harness.py groups them by limit)
    assert options.isolate == "all" and options.order == "interleaved"


class PeakMode(FakeMode):
    """A fake mode whose process and cgroup peaks are given."""

    def __init__(self, info: ModeInfo, rate: float, rss: int = 0, cgroup: int | None = None):
        super().__init__(info, rate)
        self.rss, self.cgroup = rss, cgroup

    async def decode(self, prompt, max_new_tokens, stop_ids, sampling) -> Decoded:
        decoded = await super().decode(prompt, max_new_tokens, stop_ids, sampling)
        decoded.peak_rss_bytes, decoded.cgroup_peak_bytes = self.rss, self.cgroup
        return decoded


def _under(name: str, family: str, limit: str, **fields) -> ModeInfo:
    gib = {"1GiB": 1, "3GiB": 3, "768MiB": 0.75}[limit]
    return ModeInfo(
        name=f"{name}@{limit}",
        family=family,
        limit=limit,
        memory_limit_bytes=int(gib * GIB),
        isolated=True,
        **fields,
    )


def _lever(limit: str, plan: str, anon_mib: int, file_mib: int) -> ModeInfo:
    return _under(
        "lever",
        "lever",
        limit,
        tree="gaincost",
        budget="auto",
        plan=plan,
        plan_auto=True,
        predicted_tok_s={"trees": 10.0, "lookup": 8.0, "ar": 5.0},
        idle_anon_rss_bytes=anon_mib * MIB,
        idle_file_rss_bytes=file_mib * MIB,
    )


@pytest.fixture
def curve(tmp_path) -> tuple[Path, object]:
    """A --limits run of fakes: memory-AR at 20 tok/s; under 768 MiB, 1 GiB and 3 GiB,
    Lever (plans trees, trees, ar) and both llama.cpp modes."""
    modes = [
        PeakMode(ModeInfo(name="memory-ar", family="memory-ar", isolated=True), 20.0, 2 * GIB),
        PeakMode(_lever("768MiB", "lookup", 250, 60), 6.0, int(0.7 * GIB), int(0.74 * GIB)),
        PeakMode(_under("llamacpp-ar", "llamacpp-ar", "768MiB"), 1.0, GIB // 2),
        PeakMode(_lever("1GiB", "trees", 300, 90), 12.0, int(1.1 * GIB), GIB),
        PeakMode(_under("llamacpp-ar", "llamacpp-ar", "1GiB"), 2.0, GIB // 2),
        PeakMode(_under("llamacpp-spec", "llamacpp-spec", "1GiB"), 3.0, GIB // 2),
        PeakMode(_lever("3GiB", "ar", 1200, 100), 30.0, int(1.5 * GIB), int(1.8 * GIB)),
        PeakMode(_under("llamacpp-ar", "llamacpp-ar", "3GiB"), 25.0, GIB),
        PeakMode(_under("llamacpp-spec", "llamacpp-spec", "3GiB"), 24.0, GIB),
    ]
    results = trio.run(
        functools.partial(
            run_bench,
            modes,
            SETS,
            max_new_tokens=6,
            stop_ids=frozenset(),
            config={"limits": ["768MiB", "1GiB", "3GiB"]},
            command="lever-actors bench --limits 0.75GiB,1GiB,3GiB",
        )
    )
    path = tmp_path / "benchmarks" / "results" / "memory-curve.json"
    write_results(results, path)
    return path, results


def test_the_summary_holds_the_curve_per_limit(curve):
    _, results = curve
    s = results.summary
    assert list(s.limits) == ["768MiB", "1GiB", "3GiB"]
    expected = {
        "768MiB": (6.0, 1.0, "lookup", 0.74),
        "1GiB": (12.0, 3.0, "trees", 1.1),
        "3GiB": (30.0, 25.0, "ar", 1.8),
    }
    for limit, (lever, llamacpp, decode_plan, peak) in expected.items():
        figures = s.limits[limit]
        assert figures.lever == pytest.approx(lever)
        assert figures.llamacpp_best == pytest.approx(llamacpp)
        assert figures.plan == decode_plan
        assert figures.peak_gib == pytest.approx(peak, abs=1e-6)  # the higher of the two peaks
    assert s.memory_ar_quantized == pytest.approx(20.0)
    assert s.lever_over_memory_ar_3gib == pytest.approx(30.0 / 20.0)
    assert s.idle_rss_mib == {"anon": 1200.0, "file": 100.0}  # the largest limit's


def test_the_curve_is_written_under_the_issues_names_and_read_back(curve):
    path, results = curve
    raw = json.loads(path.read_text())
    summary = raw["summary"]
    assert summary["lever_over_memory_ar_3GiB"] == pytest.approx(1.5)
    assert summary["idle_rss_mib"] == {"anon": 1200.0, "file": 100.0}
    assert summary["limits"]["1GiB"]["plan"] == "trees"
    assert summary["limits"]["1GiB"]["lever"] == pytest.approx(12.0)
    assert summary["limits"]["1GiB"]["llamacpp_best"] == pytest.approx(3.0)
    assert summary["limits"]["1GiB"]["peak_gib"] == pytest.approx(1.1, abs=1e-6)
    lever = next(m for m in raw["modes"] if m["name"] == "lever@1GiB")
    assert lever["plan"] == "trees" and lever["plan_auto"] is True
    assert lever["idle_anon_rss_bytes"] == 300 * MIB and lever["idle_file_rss_bytes"] == 90 * MIB
    assert read_results(path) == results


def test_the_report_and_the_plot_show_the_curve(curve, tmp_path):
    path, results = curve
    table = limits_lines(results)
    assert "| 1GiB | 12.00 | 3.00 | 4.00x |" in table  # no flash-AR nor SD run: no columns
    header = next(line for line in table.splitlines() if line.startswith("| limit |"))
    assert "flash-AR" not in header and "best SD" not in header
    assert table.count("| trees |") == 1 and "| ar |" in table and "| lookup |" in table
    assert "Lever under 3 GiB runs 1.50x that" in table
    assert "1200 MiB anonymous and 100 MiB of file pages" in table
    paths = output_paths(path)
    assert paths["limits"] in plots.write_plots(results, path)
    with Image.open(paths["limits"]) as image:
        assert image.format == "PNG" and image.width > 300 and image.height > 200
        assert len(image.convert("RGB").getcolors(1 << 16) or []) > 10  # not blank
    assert plots.limits_data(results) == {
        "Lever": [
            (0.75, pytest.approx(6.0)),
            (1.0, pytest.approx(12.0)),
            (3.0, pytest.approx(30.0)),
        ],
        "llama.cpp (faster mode)": [
            (0.75, pytest.approx(1.0)),
            (1.0, pytest.approx(3.0)),
            (3.0, pytest.approx(25.0)),
        ],
    }
    readme = path.parents[2] / "README.md"
    section = readme_section(results, readme, path)
    assert "![decode tok/s against the memory limit" in section
    assert "benchmarks/results/memory-curve-limits.png" in section


def test_a_limits_file_from_before_these_fields_still_reads():
    path = Path(__file__).parents[2] / "benchmarks" / "results" / "quantized.json"
    results = read_results(path)
    assert results.summary.limits and results.summary.idle_rss_mib == {}
    assert results.summary.lever_over_memory_ar_3gib is None
    assert all(f.plan is None and f.peak_gib is None for f in results.summary.limits.values())
    assert all(m.plan is None and m.idle_anon_rss_bytes is None for m in results.modes)
    assert "Lever's plan" not in limits_lines(results)  # recorded by none of its runs
