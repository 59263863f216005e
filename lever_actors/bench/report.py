"""Results as people read them, in markdown: the tables of a bench run or a sweep, and the
README's Results section (rewritten from a results file by `lever-actors report`, never typed
by hand). The PNGs are bench/plots.py's."""

from __future__ import annotations

import os
from pathlib import Path

from lever_actors.bench.concurrency_summary import OURS, SERVERS
from lever_actors.bench.joining import JOIN_AFTER_TOKENS
from lever_actors.bench.results import (
    AnyResults,
    BenchResults,
    ConcurrencyResults,
    ConcurrencyRun,
    ModeSummary,
    Summary,
    SweepResults,
)
from lever_actors.bench.summary import (
    LLAMACPP_FAMILIES,
    OFFLOADED_PEERS,
    PLAIN_FAMILIES,
    SD_FAMILIES,
    SWEEP_LINES,
    sweep_rates,
)
from lever_actors.errors import LeverError

START_MARKER = "<!-- results:start -->"
END_MARKER = "<!-- results:end -->"
DECODE_NOTE = (
    "Decode tok/s counts the tokens after the first step (which comes with the prefill) over "
    "the time after it; first token s is the time to the first token; agreement is against "
    "the first mode's tokens."
)
RATIO_LABELS = {
    "flash_ar": "flash-AR",
    "best_sd": "best SD",
    "memory_ar": "memory-resident AR",
    "peer": "transformers peer",
    "llamacpp": "llama.cpp",
}


class ReportError(LeverError, ValueError):
    """A README without well-formed results markers, or plots without matplotlib."""


def output_paths(json_path: Path) -> dict[str, Path]:
    """Where the files that go with a results JSON are written: beside it, same stem."""
    stem = json_path.with_suffix("")
    return {
        "markdown": stem.with_name(stem.name + ".md"),
        "throughput": stem.with_name(stem.name + "-throughput.png"),
        "accepted": stem.with_name(stem.name + "-accepted.png"),
        "sweep": stem.with_name(stem.name + "-sweep.png"),
        "limits": stem.with_name(stem.name + "-limits.png"),
        "concurrency": stem.with_name(stem.name + "-concurrency.png"),
    }


def render_markdown(results: AnyResults) -> str:
    if isinstance(results, SweepResults):
        return sweep_markdown(results)
    if isinstance(results, ConcurrencyResults):
        return concurrency_markdown(results)
    parts = [machine_line(results), "", *_figures(results)]
    notes = memory_note(results)
    if notes:
        parts += ["", notes]
    return "\n".join(parts) + "\n"


def _figures(results: BenchResults) -> list[str]:
    """The ratios, the table and what decode tok/s means, as parts between blank lines."""
    limits = [limits_lines(results), ""] if results.summary.limits else []
    return [*limits, summary_lines(results), "", markdown_table(results), "", DECODE_NOTE]


def limits_lines(results: BenchResults) -> str:
    """With --limits: decode tok/s of each kind of mode under each memory limit, Lever's
    ratios to them, its peak RSS and decode plan; then the memory-resident rates, Lever
    under 3 GiB over them, the idle engine's memory and the sizes."""
    s = results.summary

    def rate(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "—"

    def ratio(lever: float | None, other: float | None) -> str:
        return f"{lever / other:.2f}x" if lever is not None and other else "—"

    # each column, with the kinds of mode it needs run: a kind the run left out has no
    # columns (one that ran and failed keeps them)
    flash_ar, llamacpp = ("flash-ar",), LLAMACPP_FAMILIES
    columns: list[tuple[str, tuple[str, ...]]] = [
        ("limit", ()),
        ("Lever", ()),
        ("flash-AR", flash_ar),
        ("best SD", SD_FAMILIES),
        ("llama.cpp", llamacpp),
        ("Lever / llama.cpp", llamacpp),
        ("Lever / flash-AR", flash_ar),
        ("Lever / best SD", SD_FAMILIES),
        ("plain path", PLAIN_FAMILIES),
        ("plain / llama.cpp", PLAIN_FAMILIES),
        ("Lever peak GiB: process RSS, cgroup", ()),
        ("Lever's plan", ()),
    ]
    rows = []
    for limit, f in s.limits.items():
        peaks = [
            rate(next((v for k, v in found.items() if k.startswith("lever@")), None))
            for found in (f.peak_rss_gib, f.cgroup_peak_gib)
        ]
        rows.append(
            [
                limit,
                rate(f.lever),
                rate(f.flash_ar),
                rate(f.best_sd),
                rate(f.llamacpp_best),
                ratio(f.lever, f.llamacpp_best),
                ratio(f.lever, f.flash_ar),
                ratio(f.lever, f.best_sd),
                rate(f.plain),
                ratio(f.plain, f.llamacpp_best),
                ", ".join(peaks),
                f.plan or "—",
            ]
        )
    ran = {m.family for m in results.modes}
    plans = any(f.plan for f in s.limits.values())  # older results recorded none
    shown = [
        i
        for i, (title, needs) in enumerate(columns)
        if (not needs or ran & set(needs)) and (title != "Lever's plan" or plans)
    ]
    lines = [
        "Decode tok/s under each memory limit (all prompt sets pooled; best SD and llama.cpp: "
        "the faster of their modes; a process's RSS counts the files it maps, its cgroup's peak "
        "what the limit counted):",
        "",
        "| " + " | ".join(columns[i][0] for i in shown) + " |",
        "|" + "---|" * len(shown),
        *("| " + " | ".join(row[i] for i in shown) + " |" for row in rows),
    ]
    memory_ar = (
        f"memory-resident AR, no limit: {rate(s.memory_ar_quantized)} tok/s on the quantized layout"
    )
    if s.memory_ar_bf16 is not None:
        memory_ar += f", {rate(s.memory_ar_bf16)} dequantized to bf16"
    facts = [memory_ar]
    if s.lever_over_memory_ar_3gib is not None:
        facts.append(f"Lever under 3 GiB runs {s.lever_over_memory_ar_3gib:.2f}x that")
    if s.idle_rss_mib:
        facts.append(
            f"the idle Lever engine held {s.idle_rss_mib['anon']:.0f} MiB anonymous and "
            f"{s.idle_rss_mib['file']:.0f} MiB of file pages (RSS once open, at the largest "
            "limit)"
        )
    if s.layout_bytes and s.gguf_bytes:
        facts.append(
            f"layout {s.layout_bytes / 2**30:.2f} GiB, {s.layout_bytes / s.gguf_bytes:.2f}x its "
            f"GGUF ({s.gguf_bytes / 2**30:.2f} GiB)"
        )
    if s.min_agreement is not None:
        facts.append(
            f"lowest token agreement of our modes with {results.reference_mode}: "
            f"{s.min_agreement:.1%}"
        )
    return "\n".join([*lines, "", "; ".join(facts) + ".", *class_lines(s)])


def class_lines(s: Summary) -> list[str]:
    """Lever on auto over llama.cpp's faster mode, by class of text and limit, with the worst
    prompt and the regret of auto's plan; nothing where the run has no classes."""
    if not s.classes:
        return []
    limits = list(dict.fromkeys(limit for row in s.classes.values() for limit in row))
    lines = [
        "",
        "Lever (plan auto) / llama.cpp's faster mode, decode tok/s by class of text:",
        "",
        "| class | " + " | ".join(limits) + " |",
        "|" + "---|" * (len(limits) + 1),
    ]
    for kind, row in s.classes.items():
        cells = [f"{row[limit]:.2f}x" if limit in row else "—" for limit in limits]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    facts = []
    if s.min_prompt_ratio is not None:
        facts.append(f"worst single prompt {s.min_prompt_ratio:.2f}x")
    if s.max_plan_regret is not None:
        facts.append(
            f"the fastest forced plan ran at most {s.max_plan_regret:.2f}x auto on one prompt"
        )
    return [*lines, "", "; ".join(facts) + "."] if facts else lines


def machine_line(results: AnyResults) -> str:
    m = results.machine
    disk = ", ".join(f"{d.bandwidth / 1e9:.2f} GB/s ({d.mode})" for d in results.disk)
    memory = f", {m.memory_bytes / 2**30:.0f} GiB RAM" if m.memory_bytes else ""
    return (
        f"Measured {m.date} on {m.cpu} ({m.cores} cores{memory}), torch {m.torch_version}, "
        f"Python {m.python_version}; raw disk read bandwidth: {disk or 'not measured'}; "
        f"{m.cgroup or 'memory isolation unknown'}."
    )


def summary_lines(results: BenchResults) -> str:
    s = results.summary
    at = f" at a {s.budget} DRAM budget" if s.budget else ""
    at = f" under the {s.limit} memory limit" if s.limit else at
    if not s.per_prompt_set:
        return f"No Lever figures{at} to compare (Lever absent or failed)."
    lines = [
        f"Lever's decode speed over each baseline{at} (tok/s ratio, > 1: Lever is faster):",
        "",
    ]
    sets = list(s.per_prompt_set)
    lines.append("| baseline | mean over prompt sets | " + " | ".join(sets) + " |")
    lines.append("|---|---|" + "---|" * len(sets))
    for key, label in RATIO_LABELS.items():
        mean = getattr(s, f"lever_vs_{key}")
        if mean is None:
            continue
        cells = []
        for prompt_set in sets:
            value = getattr(s.per_prompt_set[prompt_set], f"lever_vs_{key}")
            mode = s.compared.get(prompt_set, {}).get(key)
            cells.append(f"{value:.2f}x ({mode})" if value is not None else "—")
        lines.append(f"| {label} | {mean:.2f}x | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_table(results: BenchResults) -> str:
    lines = [
        "| mode | prompt set | decode tok/s | vs Lever | first token s | tokens/step "
        "| agreement | MB read/token | effective GB/s | peak RSS GiB | memory limit GiB | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lever = {p: _lever_rate(results, p) for p in results.prompt_sets}
    for s in results.summaries:
        info = results.info(s.mode)
        theirs = lever[s.prompt_set]
        ratio = s.decode_tok_s / theirs if s.decode_tok_s is not None and theirs else None
        limit = _gib(info.memory_limit_bytes)
        if info.memory_limit_bytes is not None:
            limit += " (enforced)" if info.limit_enforced else " (not enforced)"
        status = "ok" if s.failed is None else _status(s.failed)
        lines.append(
            f"| {s.mode} | {s.prompt_set} | {_num(s.decode_tok_s)} | {_num(ratio)} "
            f"| {_num(s.mean_first_token_s)} | {_num(s.mean_accepted)} "
            f"| {_pct(s.agreement)} | {_num(s.bytes_per_token, 1e6, 1)} "
            f"| {_num(s.effective_bandwidth, 1e9)} | {_gib(_peak(s))} | {limit} | {status} |"
        )
    return "\n".join(lines)


def _status(failed: str) -> str:
    """A failed row's status: "unavailable: why" as the mode said it, else "failed: why"."""
    return _cell(failed) if failed.startswith("unavailable") else "failed: " + _cell(failed)


def memory_note(results: BenchResults) -> str:
    notes = " ".join(filter(None, [_isolation_note(results), _peer_note(results)]))
    modes = [f"{m.name}: {_cell(m.note)}." for m in results.modes if m.note]
    return "\n\n".join(filter(None, [notes, *modes, _llamacpp_note(results)]))


def _llamacpp_note(results: BenchResults) -> str:
    """How llama.cpp ran: one process per prompt, its GGUFs evicted first, the first
    prompt's command line (each run's is in the JSON)."""
    ran = [m for m in results.modes if m.family in LLAMACPP_FAMILIES and m.command]
    if not ran:
        return ""
    lines = [
        "llama.cpp ran one process per prompt, its GGUF files evicted from the page cache "
        "before each, isolated ones in a memory cgroup of their own; decode tok/s and "
        "prefill are its own timings. First prompt's command line:"
    ]
    lines += [f"- {m.name}: `{m.command}`" for m in ran]
    return "\n".join(lines)


def _peer_note(results: BenchResults) -> str:
    peers = [m for m in results.modes if m.family in OFFLOADED_PEERS]
    throttled = sorted({m.throttle for m in results.modes if m.throttle != "none"})
    notes = []
    if peers and throttled:
        notes.append(
            f"Our flash modes ran under the {', '.join(throttled)} flash profile; the peer "
            "reads the raw disk (no profile), so the comparison favours the peer."
        )
    unlimited = [m.name for m in peers if not m.limit_enforced]
    if unlimited:
        notes.append(
            f"{', '.join(unlimited)}: the offloaded weights were evicted from the page cache "
            "before each prompt, but with no memory limit enforced they stay cached after the "
            "first token, so these rows measure DRAM more than flash."
        )
    return " ".join(notes)


def _isolation_note(results: BenchResults) -> str:
    isolated = [m for m in results.modes if m.isolated]
    if not isolated:
        llamacpp = [m.name for m in results.modes if m.family in LLAMACPP_FAMILIES]
        if not llamacpp:
            return (
                "Peak RSS is of the one harness process that ran every mode (not per mode); "
                "no memory limit was enforced."
            )
        ours = [m.name for m in results.modes if m.name not in llamacpp]
        own = f"of {', '.join(llamacpp)} is llama.cpp's own process's"
        if ours:
            own = (
                f"of {', '.join(ours)} is of the one harness process that ran them (not per "
                f"mode), {own}"
            )
        return f"Peak RSS {own}; no memory limit was enforced."
    enforced = [m for m in results.modes if m.limit_enforced]
    # with --limits the memory-resident modes run in a child of their own without a limit
    unlimited = [m.name for m in isolated if m.memory_limit_bytes is None]
    if enforced and len(enforced) + len(unlimited) == len(results.modes):
        without = (
            f" ({', '.join(unlimited)}: in a process of its own, no limit)" if unlimited else ""
        )
        return (
            "Each mode ran in its own process under a kernel-enforced cgroup memory limit "
            f"(page cache included){without}; peak RSS is that process's, the cgroup's peak "
            "is used where it is higher."
        )
    if len(isolated) < len(results.modes):
        shared = ", ".join(m.name for m in results.modes if not m.isolated)
        own = ", ".join(
            m.name + (" (kernel-enforced limit)" if m.limit_enforced else "") for m in isolated
        )
        return (
            f"Each in a process of its own, peak RSS that process's: {own}. In the harness "
            f"process, sharing its peak RSS (each holds its own DRAM budget of the target and "
            f"reads past the page cache): {shared}."
        )
    return (
        "Each mode ran in its own process; peak RSS is that process's. No memory limit was "
        "enforced (limit_enforced: false)."
    )


def _lever_rate(results: BenchResults, prompt_set: str) -> float | None:
    lever = results.summary.compared.get(prompt_set, {}).get("lever")
    for s in results.summaries:
        if s.mode == lever and s.prompt_set == prompt_set:
            return s.decode_tok_s
    return None


def _peak(s: ModeSummary) -> int | None:
    values = [v for v in (s.peak_rss_bytes, s.cgroup_peak_bytes) if v is not None]
    return max(values) if values else None


def _num(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "—" if value is None else f"{value / scale:.{digits}f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _gib(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**30:.2f}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def sweep_markdown(results: SweepResults) -> str:
    rates = sweep_rates(results)
    lines = [
        machine_line(results),
        "",
        "Decode tok/s over all prompt sets; best SD is the fastest SD mode at each point.",
        "",
        "| flash profile | DRAM budget | " + " | ".join(SWEEP_LINES) + " | Lever vs flash-AR |",
        "|---|---|" + "---|" * (len(SWEEP_LINES) + 1),
    ]
    for point in results.points:
        row = rates[(point.throttle, point.budget)]
        cells = []
        for line in SWEEP_LINES:
            value, mode, failed = row.get(line, (None, None, None))
            if value is not None:
                cells.append(f"{value:.2f}" + (f" ({mode})" if line == "best SD" else ""))
            else:
                cells.append("failed: " + _cell(failed) if failed else "—")
        lever, flash = row.get("Lever", (None,))[0], row.get("flash-AR", (None,))[0]
        ratio = f"{lever / flash:.2f}x" if lever is not None and flash else "—"
        lines.append(
            f"| {point.throttle} | {point.budget} | " + " | ".join(cells) + f" | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def concurrency_markdown(results: ConcurrencyResults) -> str:
    """Per limit and requests at once: the aggregates of Lever and of llama-server without
    and with its draft, Lever's over the better server's, Lever's requests' means, peaks and
    plan; the summary's figures; failures; the servers' command lines."""
    runs = {(r.limit, r.parallel, r.engine): r for r in results.runs}
    lines = [
        machine_line(results),
        "",
        "Aggregate tok/s: every new token of the rounds over their wall time, each round from "
        "its first request's start to its last one's end (prefills included). Per request: "
        "Lever's mean decode tok/s and time to first token.",
        "",
        "| limit | at once | Lever | llama-server | llama-server + draft | Lever / better "
        "server | Lever per request tok/s | Lever first token s | Lever peak GiB: RSS, "
        "cgroup | Lever's plan |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for limit, parallel in dict.fromkeys((r.limit, r.parallel) for r in results.runs):
        ours = runs.get((limit, parallel, OURS))
        servers = [runs.get((limit, parallel, engine)) for engine in SERVERS]
        rates = [run.aggregate_tok_s for run in servers if run and run.aggregate_tok_s]
        lever = ours.aggregate_tok_s if ours else None
        ratio = f"{lever / max(rates):.2f}x" if lever is not None and rates else "—"
        cells = [_aggregate(run) for run in (ours, *servers)]
        lines.append(
            f"| {limit} | {parallel} | " + " | ".join(cells) + f" | {ratio} "
            f"| {_num(ours.mean_request_decode_tok_s if ours else None)} "
            f"| {_num(ours.mean_first_token_s if ours else None)} "
            f"| {_gib(ours.peak_rss_bytes if ours else None)}, "
            f"{_gib(ours.cgroup_peak_bytes if ours else None)} "
            f"| {(ours.plan if ours else None) or '—'} |"
        )
    s = results.summary
    lines += [
        "",
        "Lever's aggregate with 4 at once over 1, under 1 GiB: "
        f"{_times(s.aggregate_4_over_1_at_1gib)}; over the better llama-server's with 4 "
        f"slots: {_times(s.aggregate_4_vs_llamacpp_server_1gib)} under 1 GiB, "
        f"{_times(s.aggregate_4_vs_llamacpp_server_3gib)} under 3 GiB (with 1 and 8: "
        f"{_times(s.aggregate_1_vs_llamacpp_server_3gib)}, "
        f"{_times(s.aggregate_8_vs_llamacpp_server_3gib)}); lowest agreement of "
        f"Lever's concurrent requests with their sequential runs: {_pct(s.min_agreement)}.",
    ]
    joined = [r for r in results.runs if r.joining is not None]
    if joined:
        lines += [
            "",
            "A prompt joining Lever's requests already decoding (the longest, "
            f"{JOIN_AFTER_TOKENS} tokens into their answers): its first token's time beside "
            "them over alone, and their longest gap meanwhile over their step before "
            f"(worst: {_times(s.ttft_joining_busy_over_alone)}, "
            f"{_times(s.joining_gap_over_step)}).",
            "",
            "| limit | decoding | prompt tokens | first token alone s | beside them s | "
            "their step s | their longest gap s |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in joined:
            j = r.joining
            assert j is not None
            lines.append(
                f"| {r.limit} | {j.running} | {j.prompt_tokens} | {j.first_token_alone_s:.2f} "
                f"| {j.first_token_busy_s:.2f} | {j.step_s:.3f} | {_num(j.gap_s, digits=3)} |"
            )
    failed = [
        f"- {r.engine} under {r.limit}, {r.parallel} at once: {_cell(r.failed)}"
        for r in results.runs
        if r.failed is not None
    ]
    if failed:
        lines += ["", "Failed:", *failed]
    commands: dict[str, str] = {}
    for r in results.runs:
        if r.command:
            commands.setdefault(r.engine, r.command)
    if commands:
        lines += ["", "llama-server, stopped after each limit and count; its first command line:"]
        lines += [f"- {engine}: `{command}`" for engine, command in commands.items()]
    return "\n".join(lines) + "\n"


def _aggregate(run: ConcurrencyRun | None) -> str:
    if run is None:
        return "—"
    if run.failed is not None:
        return "unavailable" if run.failed.startswith("unavailable") else "failed"
    return _num(run.aggregate_tok_s)


def _times(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def readme_section(results: BenchResults, readme: Path, json_path: Path) -> str:
    """The text between the markers, short: machine, command, the headline figures (the
    limits table, else the ratios), a link to the full report and the plots."""
    base = readme.parent
    paths = output_paths(json_path)
    headline = limits_lines(results) if results.summary.limits else summary_lines(results)
    report = _rel(paths["markdown"], base)
    parts = [
        f"<!-- generated by `lever-actors report {_rel(json_path, base)} --readme "
        f"{_rel(readme, base)}`; edits here are overwritten -->",
        machine_line(results),
        f"Produced by `{results.command or '(command not recorded)'}`.",
        "",
        headline,
        "",
        f"Every mode and prompt set: [{report}]({report}); raw figures: "
        f"[{_rel(json_path, base)}]({_rel(json_path, base)}).",
    ]
    images = [
        f"![{label}]({_rel(paths[key], base)})"
        for key, label in (
            ("throughput", "decode throughput normalised to Lever"),
            ("accepted", "accepted tokens per step per tree policy"),
            ("limits", "decode tok/s against the memory limit, Lever and llama.cpp"),
        )
        if paths[key].is_file()
    ]
    if images:
        parts += ["", *images]
    return "\n".join(parts)


def rewrite_readme(readme: Path, section: str) -> None:
    """Replace what lies between the results markers of `readme` with `section`; nothing
    else in the file changes."""
    try:
        text = readme.read_text()
    except OSError as e:
        raise ReportError(f"{readme}: cannot read ({e.strerror})") from None
    starts, ends = text.count(START_MARKER), text.count(END_MARKER)
    if starts != 1 or ends != 1:
        raise ReportError(
            f"{readme}: needs exactly one {START_MARKER} and one {END_MARKER} line around the "
            f"results section (found {starts} and {ends})"
        )
    head, rest = text.split(START_MARKER)
    if END_MARKER not in rest:
        raise ReportError(f"{readme}: {END_MARKER} comes before {START_MARKER}")
    _, tail = rest.split(END_MARKER)
    new = f"{head}{START_MARKER}\n{section.strip()}\n{END_MARKER}{tail}"
    tmp = readme.with_name(f".{readme.name}.partial-{os.getpid()}")
    tmp.write_text(new)
    os.replace(tmp, readme)


def _rel(path: Path, base: Path) -> str:
    return os.path.relpath(path.resolve(), base.resolve())
