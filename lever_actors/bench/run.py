"""A benchmark run from options to files: plan the modes, run them (in this process or one
child process each), measure the raw disk in the same run, write JSON, markdown and PNGs.
With `--parallel` the run is the requests-at-once one (bench/concurrency.py). The scaling
sweep is such runs over DRAM budgets x flash profiles. The CLI makes the workload from
prompt sets and a tokenizer; tests pass token ids directly."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import msgspec
import trio

from lever_actors.bench.child import ChildMode
from lever_actors.bench.concurrency import parallel_runs
from lever_actors.bench.harness import Workload, run_bench
from lever_actors.bench.isolation import CgroupSupport, probe_cgroup
from lever_actors.bench.llamacpp import LlamaCppMode, LlamaCppSpec
from lever_actors.bench.mode import Mode
from lever_actors.bench.opening import open_in_process
from lever_actors.bench.plan import BenchOptions, gguf_of, plan_modes
from lever_actors.bench.plots import write_plots
from lever_actors.bench.report import ReportError, output_paths, render_markdown
from lever_actors.bench.results import (
    AnyResults,
    BenchResults,
    ConcurrencyResults,
    Machine,
    SweepPoint,
    SweepResults,
    write_results,
)
from lever_actors.bench.specs import PlannedMode
from lever_actors.config import DramBudget
from lever_actors.device.disk_profile import DiskProfile, profile_disk
from lever_actors.device.manifest import MANIFEST_NAME, WEIGHTS_NAME, read_manifest
from lever_actors.draft import DraftModel
from lever_actors.model import native

R = TypeVar("R", bound=AnyResults)  # any results, as it came

DISK_PROFILE_BYTES = 2**30  # read at most this much of the layout to measure the raw disk
SWEEP_FAMILIES = ("flash-ar", "sd-chain", "sd-static", "lever")
SWEEP_BUDGETS = tuple(DramBudget.parse(f"{p}%") for p in range(10, 101, 10))
SWEEP_THROTTLES = ("ufs3.1", "ufs4.0", "none")


def bench(
    options: BenchOptions,
    workload: Workload,
    *,
    out: Path | None = None,
    command: str = "",
    plots: bool = True,
    log=None,
) -> BenchResults | ConcurrencyResults:
    """Every mode of `options` on the workload, or with `options.parallel` its requests at
    once (bench/concurrency.py), with the raw disk measured before and after; the files go
    to `out` and beside it."""
    log = log or sys.stderr  # looked up now: tests and callers may replace it
    cgroups = isolation_support(options, log)
    run: Callable[[], BenchResults | ConcurrencyResults]
    if options.parallel:
        # our kernels are built here, once: a child would build them under its limit
        native.in_use()
        run = functools.partial(parallel_runs, options, workload, cgroups, command, log)
    else:
        modes = make_modes(plan_modes(options, workload.target, workload.draft), cgroups, {})
        run = functools.partial(run_modes, modes, workload, options, command, log)
    before = measure_disk(workload.target)
    results = with_disk(run(), [before, measure_disk(workload.target)])
    if isinstance(results, BenchResults) and options.limits:
        results = with_sizes(results, workload.target)
    if out is not None:
        write_outputs(results, out, plots=plots, log=log)
    return results


def with_sizes(results: BenchResults, target: Path) -> BenchResults:
    """The summary with the bytes of the target's layout and of the GGUF it came from."""
    source = gguf_of(target)
    sizes = {
        "layout_bytes": read_manifest(target).file_bytes,
        "gguf_bytes": source.stat().st_size if source else None,
    }
    return msgspec.structs.replace(
        results, summary=msgspec.structs.replace(results.summary, **sizes)
    )


def sweep(
    options: BenchOptions,
    workload: Workload,
    *,
    budgets: Sequence[DramBudget] = SWEEP_BUDGETS,
    throttles: Sequence[str] = SWEEP_THROTTLES,
    out: Path | None = None,
    command: str = "",
    plots: bool = True,
    log=None,
) -> SweepResults:
    """flash-AR, the best SD mode and Lever at each budget x flash profile, to show where
    Lever's gain comes from and how it degrades. Each point is one run of its modes, opened
    for that point only (memory holds one point's engines at a time). Modes of `options`
    outside SWEEP_FAMILIES are dropped (default: all four families)."""
    log = log or sys.stderr  # looked up now: tests and callers may replace it
    families = tuple(m for m in options.modes if m in SWEEP_FAMILIES) or SWEEP_FAMILIES
    manifest = read_manifest(workload.target)
    cgroups = isolation_support(options, log)
    drafts: dict[tuple[str, str], DraftModel] = {}  # loaded once for all in-process points
    disk = [measure_disk(workload.target)]
    points = []
    for throttle in throttles:
        for budget in budgets:
            print(f"sweep point: flash profile {throttle}, DRAM budget {budget}", file=log)
            point_options = msgspec.structs.replace(
                options, modes=families, budgets=(budget,), throttle=throttle
            )
            planned = plan_modes(point_options, workload.target, workload.draft)
            modes = make_modes(planned, cgroups, drafts)
            points.append(
                SweepPoint(
                    throttle=throttle,
                    budget=str(budget),
                    budget_bytes=budget.bytes_of(manifest.file_bytes),
                    target_bytes=manifest.file_bytes,
                    results=run_modes(modes, workload, point_options, command, log),
                )
            )
    disk.append(measure_disk(workload.target))
    config = options.as_config() | {
        "sweep_budgets": [str(b) for b in budgets],
        "sweep_throttles": list(throttles),
    }
    results = SweepResults(machine=Machine.here(), command=command, config=config, points=points)
    results = with_disk(results, disk)
    if out is not None:
        write_outputs(results, out, plots=plots, log=log)
    return results


def make_modes(
    planned: Sequence[PlannedMode],
    cgroups: CgroupSupport | None,
    drafts: dict[tuple[str, str], DraftModel],
) -> list[Mode]:
    """An isolated mode runs in a child process of its own (under a memory cgroup where
    `cgroups` is usable); the others run in this process and share loaded drafts. A
    llama.cpp mode is driven from this process: its program is the process of its own,
    and only that goes under the limit (see bench/llamacpp.py)."""
    if any(p.info.isolated and not isinstance(p.spec, LlamaCppSpec) for p in planned):
        # build our kernels here, once (where in use): a child would build them under its
        # memory limit, where the compiler's 300 MB beside the model thrash for minutes
        native.in_use()
    modes: list[Mode] = []
    for p in planned:
        if isinstance(p.spec, LlamaCppSpec):
            modes.append(LlamaCppMode(p.info, p.spec, cgroups))
        elif p.info.isolated:
            modes.append(ChildMode(p, cgroups))
        else:
            modes.append(open_in_process(p, drafts))
    return modes


def isolation_support(options: BenchOptions, log) -> CgroupSupport | None:
    """What the machine offers the isolated modes, if any; says so when limits are not
    possible."""
    if options.isolate == "none":
        return None
    cgroups = probe_cgroup()
    if not cgroups.usable:
        print(f"--isolate: {cgroups.describe()}; peak RSS only", file=log)
    return cgroups


def run_modes(
    modes: Sequence[Mode], workload: Workload, options: BenchOptions, command: str, log
) -> BenchResults:
    """One interleaved (or sequential) pass of `modes` over the prompts, in its own trio run,
    compared at the first budget."""
    return trio.run(
        functools.partial(
            run_bench,
            modes,
            workload.prompt_sets,
            max_new_tokens=options.max_new_tokens,
            stop_ids=workload.stop_ids,
            config=options.as_config(),
            command=command,
            order=options.order,
            budget=str(options.budgets[0]) if options.budgets else None,
            sampling=options.sampling,
            log=log,
        )
    )


def measure_disk(target: Path) -> DiskProfile | None:
    """Raw sequential read bandwidth under the target's flash layout, in layer-sized reads."""
    if not (target / MANIFEST_NAME).is_file():
        return None
    manifest = read_manifest(target)
    layer_bytes = max(manifest.layer(i).nbytes for i in range(manifest.args.n_layers))
    return profile_disk(target / WEIGHTS_NAME, layer_bytes, DISK_PROFILE_BYTES)


def with_disk(results: R, profiles: list[DiskProfile | None]) -> R:
    """`results` with the raw disk profiles of the run and their mean."""
    measured = [p for p in profiles if p is not None]
    bandwidth = sum(p.bandwidth for p in measured) / len(measured) if measured else None
    machine = msgspec.structs.replace(results.machine, disk_bandwidth=bandwidth)
    return msgspec.structs.replace(results, machine=machine, disk=measured)


def write_outputs(
    results: AnyResults, json_path: Path, *, plots: bool = True, log=None
) -> list[Path]:
    """The JSON, its markdown and (when matplotlib is installed) its PNGs; returns the paths."""
    log = log or sys.stderr  # looked up now: tests and callers may replace it
    write_results(results, json_path)
    markdown = output_paths(json_path)["markdown"]
    markdown.write_text(render_markdown(results))
    written = [json_path, markdown]
    if plots:
        try:
            written += write_plots(results, json_path)
        except ReportError as e:  # no matplotlib
            print(f"no plots: {e}", file=log)
    return written
