"""One benchmark run from options to files: plan the modes, run them (in this process or
one child process each), measure the raw disk in the same run, write JSON, markdown, PNGs.
The CLI adds prompt sets and a tokenizer; tests pass token ids directly."""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
import trio

from lever_actors.bench.harness import PromptSet, run_bench
from lever_actors.bench.isolation import CgroupSupport, probe_cgroup
from lever_actors.bench.report import write_outputs
from lever_actors.bench.results import BenchResults
from lever_actors.bench.specs import BenchOptions, PlannedMode, open_in_process, plan_modes
from lever_actors.device.disk_profile import DiskProfile, profile_disk
from lever_actors.device.layout import MANIFEST_NAME, WEIGHTS_NAME, read_manifest

DISK_PROFILE_BYTES = 2**30  # read at most this much of the layout to measure the raw disk


def make_modes(
    planned: Sequence[PlannedMode],
    options: BenchOptions,
    cgroups: CgroupSupport | None = None,
    drafts: dict | None = None,
) -> list:
    """An isolated mode runs in a child process of its own (under a memory cgroup where
    `cgroups` is usable); the others run in this process and share loaded drafts."""
    from lever_actors.bench.isolated_mode import ChildMode

    drafts = {} if drafts is None else drafts
    return [
        ChildMode(p, cgroups) if p.info.isolated else open_in_process(p, drafts) for p in planned
    ]


def isolation_support(options: BenchOptions, log) -> CgroupSupport | None:
    """What the machine offers the isolated modes, if any; says so when limits are not
    possible."""
    if options.isolate == "none":
        return None
    cgroups = probe_cgroup()
    if not cgroups.usable:
        print(f"--isolate: {cgroups.describe()}; peak RSS only", file=log)
    return cgroups


def measure_disk(target: Path) -> DiskProfile | None:
    """Raw sequential read bandwidth under the target's flash layout, in layer-sized reads."""
    if not (target / MANIFEST_NAME).is_file():
        return None
    manifest = read_manifest(target)
    layer_bytes = max(manifest.layer(i).nbytes for i in range(manifest.args.n_layers))
    return profile_disk(target / WEIGHTS_NAME, layer_bytes, DISK_PROFILE_BYTES)


def with_disk(results, profiles: list[DiskProfile | None]):
    """`results` (bench or sweep) with the raw disk profiles of the run and their mean."""
    profiles = [p for p in profiles if p is not None]
    bandwidth = sum(p.bandwidth for p in profiles) / len(profiles) if profiles else None
    machine = msgspec.structs.replace(results.machine, disk_bandwidth=bandwidth)
    return msgspec.structs.replace(results, machine=machine, disk=profiles)


def run_modes(modes, prompt_sets, options: BenchOptions, stop_ids, command, budget, log):
    """One interleaved (or sequential) pass of `modes` over the prompts, in its own trio run."""
    return trio.run(
        functools.partial(
            run_bench,
            modes,
            prompt_sets,
            max_new_tokens=options.max_new_tokens,
            stop_ids=stop_ids,
            config=options.as_config(),
            command=command,
            order=options.order,
            budget=budget,
            log=log,
        )
    )


def bench(
    options: BenchOptions,
    target: Path,
    draft: Path | None,
    prompt_sets: Sequence[PromptSet],
    stop_ids: frozenset[int],
    *,
    out: Path | None = None,
    command: str = "",
    plots: bool = True,
    log=None,
) -> BenchResults:
    log = log or sys.stderr  # looked up now: tests and callers may replace it
    cgroups = isolation_support(options, log)
    planned = plan_modes(options, target, draft)
    modes = make_modes(planned, options, cgroups)
    before = measure_disk(target)
    budget = options.budgets[0] if options.budgets else None
    results = run_modes(modes, prompt_sets, options, stop_ids, command, budget, log)
    results = with_disk(results, [before, measure_disk(target)])
    if out is not None:
        write_outputs(results, out, plots=plots, log=log)
    return results
