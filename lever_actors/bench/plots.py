"""PNG plots of results, drawn with matplotlib (the `bench` extra). Each plot returns the
figures it drew, so that tests can hold them to the raw results."""

from __future__ import annotations

from pathlib import Path

from lever_actors.bench.concurrency_summary import ENGINES
from lever_actors.bench.report import ReportError, output_paths
from lever_actors.bench.results import AnyResults, BenchResults, ConcurrencyResults, SweepResults
from lever_actors.bench.summary import SWEEP_LINES, budget_percent, sweep_rates
from lever_actors.sizes import parse_bytes


def write_plots(results: AnyResults, json_path: Path) -> list[Path]:
    """The PNGs that go with a results JSON, beside it; raises ReportError without matplotlib."""
    paths = output_paths(json_path)
    if isinstance(results, SweepResults):
        sweep_plot(results, paths["sweep"])
        return [paths["sweep"]]
    if isinstance(results, ConcurrencyResults):
        concurrency_plot(results, paths["concurrency"])
        return [paths["concurrency"]]
    throughput_plot(results, paths["throughput"])
    accepted_plot(results, paths["accepted"])
    written = [paths["throughput"], paths["accepted"]]
    if results.summary.limits:
        limits_plot(results, paths["limits"])
        written.append(paths["limits"])
    return written


def _pyplot():
    try:
        import matplotlib  # optional: the `bench` extra
    except ImportError:
        raise ReportError("PNG plots need matplotlib: pip install 'lever-actors[bench]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # optional: the `bench` extra

    return plt


def throughput_data(results: BenchResults) -> dict[str, dict[str, float | None]]:
    """mode -> prompt set -> decode tok/s divided by Lever's on that set (None: failed)."""
    lever = {p: results.summary.compared.get(p, {}).get("lever") for p in results.prompt_sets}
    rate = {(s.mode, s.prompt_set): s.decode_tok_s for s in results.summaries}
    data: dict[str, dict[str, float | None]] = {}
    for info in results.modes:
        data[info.name] = {}
        for p in results.prompt_sets:
            mode = lever[p]
            ours = rate.get((info.name, p))
            theirs = rate.get((mode, p)) if mode is not None else None
            data[info.name][p] = ours / theirs if ours is not None and theirs else None
    return data


def _grouped_bars(
    ax, data: dict[str, dict[str, float | None]], modes: list[str], sets: list[str]
) -> list[tuple[str, list[float]]]:
    """A group of bars per mode, one bar per prompt set (a missing value as 0).
    -> (prompt set, x of its bar in each group)"""
    width = 0.8 / max(len(sets), 1)
    placed = []
    for j, prompt_set in enumerate(sets):
        xs = [i + (j - (len(sets) - 1) / 2) * width for i in range(len(modes))]
        ax.bar(xs, [data[m][prompt_set] or 0.0 for m in modes], width, label=prompt_set)
        placed.append((prompt_set, xs))
    return placed


def throughput_plot(results: BenchResults, path: Path) -> dict[str, dict[str, float | None]]:
    plt = _pyplot()
    data = throughput_data(results)
    modes, sets = list(data), results.prompt_sets
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(modes) + 2), 4.5))
    for prompt_set, xs in _grouped_bars(ax, data, modes, sets):
        for x, m in zip(xs, modes, strict=True):
            if data[m][prompt_set] is None:
                ax.text(x, 0.02, "failed", rotation=90, ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(modes)), modes, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("decode tok/s relative to Lever")
    ax.set_title(f"Throughput normalised to Lever ({results.machine.date})")
    ax.legend(title="prompt set", fontsize=8)
    _save(fig, path)
    return data


def accepted_data(results: BenchResults) -> dict[str, dict[str, float | None]]:
    """mode (those with a draft tree) -> prompt set -> mean accepted tokens per step."""
    accepted = {(s.mode, s.prompt_set): s.mean_accepted for s in results.summaries}
    return {
        info.name: {p: accepted.get((info.name, p)) for p in results.prompt_sets}
        for info in results.modes
        if info.tree is not None
    }


def accepted_plot(results: BenchResults, path: Path) -> dict[str, dict[str, float | None]]:
    plt = _pyplot()
    data = accepted_data(results)
    modes, sets = list(data), results.prompt_sets
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(modes) + 2), 4.5))
    _grouped_bars(ax, data, modes, sets)
    labels = [f"{m}\n({results.info(m).tree})" for m in modes]
    ax.set_xticks(range(len(modes)), labels, rotation=35, ha="right", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylabel("new tokens per target pass")
    ax.set_title("Accepted tokens per step, per tree policy")
    if modes:
        ax.legend(title="prompt set", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no speculative modes in this run", ha="center", transform=ax.transAxes)
    _save(fig, path)
    return data


def sweep_plot(
    results: SweepResults, path: Path
) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """One panel per flash profile: decode tok/s against the DRAM budget (% of the target)
    for flash-AR, the best SD mode and Lever. Returns profile -> line -> [(budget %, tok/s)]."""
    plt = _pyplot()
    rates = sweep_rates(results)
    throttles = list(dict.fromkeys(p.throttle for p in results.points))
    data: dict[str, dict[str, list[tuple[float, float]]]] = {}
    fig, axes = plt.subplots(1, len(throttles), figsize=(4.5 * len(throttles), 4), squeeze=False)
    for ax, throttle in zip(axes[0], throttles, strict=True):
        data[throttle] = {}
        for line in SWEEP_LINES:
            points = []
            for p in results.points:
                if p.throttle != throttle:
                    continue
                value = rates[(p.throttle, p.budget)].get(line, (None,))[0]
                if value is not None:
                    points.append((budget_percent(p), value))
            data[throttle][line] = points
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=line)
        ax.set_title(f"flash profile: {throttle}")
        ax.set_xlabel("DRAM budget (% of target weights)")
        ax.set_ylabel("decode tok/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path)
    return data


LIMIT_LINES = {"Lever": "lever", "llama.cpp (faster mode)": "llamacpp_best"}


def limits_data(results: BenchResults) -> dict[str, list[tuple[float, float]]]:
    """line -> [(memory limit in GiB, decode tok/s)] from the --limits summary, in the order
    of the limits; a limit where the line has no rate (failed, absent) is left out."""
    data: dict[str, list[tuple[float, float]]] = {line: [] for line in LIMIT_LINES}
    for limit, figures in results.summary.limits.items():
        for line, field in LIMIT_LINES.items():
            value = getattr(figures, field)
            if value is not None:
                data[line].append((parse_bytes(limit) / 2**30, value))
    return data


def limits_plot(results: BenchResults, path: Path) -> dict[str, list[tuple[float, float]]]:
    """Decode tok/s against the memory limit, Lever and llama.cpp's faster mode on one axis;
    Lever's points are labelled with the decode plan it ran there."""
    plt = _pyplot()
    data = limits_data(results)
    plans = {
        parse_bytes(limit) / 2**30: f.plan for limit, f in results.summary.limits.items() if f.plan
    }
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for line, points in data.items():
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=line)
    for x, y in data["Lever"]:
        if x in plans:
            ax.annotate(plans[x], (x, y), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xlabel("memory limit (GiB)")
    ax.set_ylabel("decode tok/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Decode speed under each memory limit ({results.machine.date})")
    ax.grid(alpha=0.3)
    if any(data.values()):
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no rates under any limit", ha="center", transform=ax.transAxes)
    _save(fig, path)
    return data


def concurrency_data(results: ConcurrencyResults) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """limit -> engine -> [(requests at once, aggregate tok/s)], in the order run; a run
    without an aggregate (failed, unavailable) is left out."""
    data: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for run in results.runs:
        lines = data.setdefault(run.limit, {engine: [] for engine in ENGINES})
        if run.aggregate_tok_s is not None:
            lines[run.engine].append((run.parallel, run.aggregate_tok_s))
    return data


def concurrency_plot(
    results: ConcurrencyResults, path: Path
) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """One panel per memory limit: aggregate tok/s against the requests at once, for Lever
    and llama-server without and with its draft."""
    plt = _pyplot()
    data = concurrency_data(results)
    panels = max(len(data), 1)
    fig, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 4), squeeze=False)
    for ax, (limit, lines) in zip(axes[0], data.items(), strict=False):
        for engine, points in lines.items():
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=engine)
        counts = sorted({n for points in lines.values() for n, _ in points})
        ax.set_title(f"under {limit}")
        ax.set_xlabel("requests at once")
        ax.set_ylabel("aggregate tok/s")
        ax.set_xscale("log", base=2)  # 1, 2, 4, 8 evenly apart
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if any(lines.values()):
            ax.legend(fontsize=8)
    _save(fig, path)
    return data


def _save(fig, path: Path) -> None:
    """Lay out, write and let go of a finished figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
