"""The scaling sweep on the tiny pair: flash-AR, the best SD mode and Lever at each DRAM
budget x flash profile, to JSON, markdown and one PNG; a budget below the minimum is a
failed point, not a crash."""

from __future__ import annotations

import pytest
from PIL import Image

from lever_actors.bench import plots
from lever_actors.bench.plan import BenchOptions
from lever_actors.bench.report import output_paths
from lever_actors.bench.results import SweepResults, read_results
from lever_actors.bench.run import sweep
from lever_actors.bench.summary import pooled_decode_rate, sweep_rates
from lever_actors.cli import main
from lever_actors.config import DramBudget


def test_sweep(one_set, tmp_path):
    options = BenchOptions(
        modes=("flash-ar", "sd-chain", "sd-static", "lever", "memory-ar"),
        chain=(2,),
        static_tree="2,1",
        draft_dtype="float32",
        prompt_sets=("humaneval",),
        prompts=1,
        max_new_tokens=5,
        cache_dir=str(tmp_path / "cache"),
    )
    out = tmp_path / "sweep.json"
    results = sweep(
        options,
        one_set,
        budgets=tuple(DramBudget.parse(b) for b in ("10%", "60%", "100%")),
        throttles=("ufs4.0", "none"),
        out=out,
    )
    assert isinstance(read_results(out), SweepResults)
    assert [(p.throttle, p.budget) for p in results.points] == [
        (t, b) for t in ("ufs4.0", "none") for b in ("10%", "60%", "100%")
    ]
    rates = sweep_rates(results)
    for point in results.points:
        names = [m.name for m in point.results.modes]  # memory-ar is not a sweep mode
        assert names == [
            f"flash-ar@{point.budget}",
            f"sd-chain:2@{point.budget}",
            f"sd-static:2,1@{point.budget}",
            f"lever@{point.budget}",
        ]
        assert all(m.throttle == point.throttle for m in point.results.modes)
        row = rates[(point.throttle, point.budget)]
        if point.budget == "10%":  # below the LM head + two layer slots
            for line in ("flash-AR", "best SD", "Lever"):
                value, _, failed = row[line]
                assert value is None and "below the minimum" in failed
            continue
        runs = point.results.runs
        for line, mode in (
            ("flash-AR", f"flash-ar@{point.budget}"),
            ("Lever", f"lever@{point.budget}"),
        ):
            assert row[line][0] == pytest.approx(
                pooled_decode_rate([r for r in runs if r.mode == mode])
            )
        sd = {
            m: pooled_decode_rate([r for r in runs if r.mode == m])
            for m in (f"sd-chain:2@{point.budget}", f"sd-static:2,1@{point.budget}")
        }
        assert row["best SD"][0] == pytest.approx(max(sd.values()))
        assert row["best SD"][1] == max(sd, key=sd.get)

    png = output_paths(out)["sweep"]
    with Image.open(png) as image:
        assert image.format == "PNG" and image.width > 600
    data = plots.sweep_plot(results, tmp_path / "again.png")
    assert set(data) == {"ufs4.0", "none"}
    for throttle, lines in data.items():
        for line, points in lines.items():
            assert [x for x, _ in points] == pytest.approx([60.0, 100.0], abs=0.01)
            for (_, y), budget in zip(points, ("60%", "100%"), strict=True):
                assert y == pytest.approx(rates[(throttle, budget)][line][0])
    text = output_paths(out)["markdown"].read_text()
    assert text.count("| ufs4.0 |") == 3 and "below the minimum" in text
    assert "nan" not in text.lower()
    assert main(["report", str(out)]) == 0  # redraws the PNG, rewrites the markdown
    assert output_paths(out)["markdown"].read_text() == text
    assert main(["report", str(out), "--readme", str(tmp_path / "README.md")]) == 2
