"""The scaling sweep: flash-AR, the best SD mode and Lever over DRAM budgets x flash profiles,
to show where Lever's gain comes from and how it degrades. Each point is one bench run of
its modes (opened for that point only, so memory holds one point's engines at a time)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec

from lever_actors.bench.harness import PromptSet
from lever_actors.bench.report import write_outputs
from lever_actors.bench.results import Machine, SweepPoint, SweepResults
from lever_actors.bench.run import (
    isolation_support,
    make_modes,
    measure_disk,
    run_modes,
    with_disk,
)
from lever_actors.bench.specs import BenchOptions, plan_modes
from lever_actors.bench.summary import SD_FAMILIES, decode_rate
from lever_actors.device.budget import resolve_budget
from lever_actors.device.layout import read_manifest

DEFAULT_BUDGETS = tuple(f"{p}%" for p in range(10, 101, 10))
DEFAULT_THROTTLES = ("ufs3.1", "ufs4.0", "none")
SWEEP_FAMILIES = ("flash-ar", "sd-chain", "sd-static", "lever")
SWEEP_LINES = ("flash-AR", "best SD", "Lever")
_LINE_FAMILIES = {"flash-AR": ("flash-ar",), "best SD": SD_FAMILIES, "Lever": ("lever",)}


def sweep(
    options: BenchOptions,
    target: Path,
    draft: Path | None,
    prompt_sets: Sequence[PromptSet],
    stop_ids: frozenset[int],
    *,
    budgets: Sequence[str] = DEFAULT_BUDGETS,
    throttles: Sequence[str] = DEFAULT_THROTTLES,
    out: Path | None = None,
    command: str = "",
    plots: bool = True,
    log=None,
) -> SweepResults:
    """Modes of `options` outside SWEEP_FAMILIES are dropped (default: all four families)."""
    log = log or sys.stderr  # looked up now: tests and callers may replace it
    families = tuple(m for m in options.modes if m in SWEEP_FAMILIES) or SWEEP_FAMILIES
    manifest = read_manifest(target)
    cgroups = isolation_support(options, log)
    drafts: dict = {}  # in-process runs load the draft once for all points
    disk = [measure_disk(target)]
    points = []
    for throttle in throttles:
        for budget in budgets:
            print(f"sweep point: flash profile {throttle}, DRAM budget {budget}", file=log)
            point_options = msgspec.structs.replace(
                options, modes=families, budgets=(budget,), throttle=throttle
            )
            modes = make_modes(
                plan_modes(point_options, target, draft), point_options, cgroups, drafts
            )
            results = run_modes(modes, prompt_sets, point_options, stop_ids, command, budget, log)
            points.append(
                SweepPoint(
                    throttle=throttle,
                    budget=budget,
                    budget_bytes=resolve_budget(budget, manifest.file_bytes),
                    target_bytes=manifest.file_bytes,
                    results=results,
                )
            )
    disk.append(measure_disk(target))
    config = options.as_config() | {
        "sweep_budgets": list(budgets),
        "sweep_throttles": list(throttles),
    }
    results = SweepResults(machine=Machine.here(), command=command, config=config, points=points)
    results = with_disk(results, disk)
    if out is not None:
        write_outputs(results, out, plots=plots, log=log)
    return results


def sweep_rates(
    results: SweepResults,
) -> dict[tuple[str, str], dict[str, tuple[float | None, str | None, str | None]]]:
    """(throttle, budget) -> line -> (decode tok/s over all prompt sets, mode, failure).
    For "best SD" the mode is the fastest SD mode at that point."""
    out = {}
    for point in results.points:
        r = point.results
        row = {}
        for line, families in _LINE_FAMILIES.items():
            candidates = []
            failure = None
            for info in r.modes:
                if info.family not in families:
                    continue
                runs = [x for x in r.runs if x.mode == info.name]
                failed = next((x.failed for x in runs if x.failed is not None), None)
                failure = failure or failed
                rate = decode_rate(runs)
                if rate is not None:
                    candidates.append((rate, info.name))
            if candidates:
                rate, mode = max(candidates)
                row[line] = (rate, mode, None)
            elif failure is not None:
                row[line] = (None, None, failure)
        out[(point.throttle, point.budget)] = row
    return out


def budget_percent(point: SweepPoint) -> float:
    return 100.0 * point.budget_bytes / point.target_bytes
