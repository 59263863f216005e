"""Figures computed from the raw per-prompt runs: agreement with the reference mode, each
mode's summary per prompt set, Lever's speed-up over each baseline, and the lines of the
scaling sweep. Nothing here runs a model or writes a file."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from lever_actors.bench.results import (
    LimitFigures,
    ModeInfo,
    ModeSummary,
    PromptRun,
    Ratios,
    Summary,
    SweepPoint,
    SweepResults,
)
from lever_actors.channels.stats import decode_rate, per_step
from lever_actors.sizes import parse_bytes

SD_FAMILIES = ("sd-chain", "sd-static")
OFFLOADED_PEERS = ("peer-offload", "peer-assisted")  # the peers that read from flash
LLAMACPP_FAMILIES = ("llamacpp-ar", "llamacpp-spec")  # llama.cpp's programs (bench/llamacpp.py)
# the plain path (#63), without torch (bench/plain_mode.py): `generate --plan ar` and
# `--plan lookup` (copies from the text verified beside each pass)
PLAIN_FAMILIES = ("lever-plain", "lever-plain-lookup")
BASELINES = ("flash_ar", "best_sd", "memory_ar", "peer", "llamacpp")
SWEEP_LINES = ("flash-AR", "best SD", "Lever")
_LINE_FAMILIES = {"flash-AR": ("flash-ar",), "best SD": SD_FAMILIES, "Lever": ("lever",)}


def pooled_decode_rate(runs: Sequence[PromptRun]) -> float | None:
    """Tokens of the decode phase (after the first step, which comes with the prefill) per
    second of decoding, over all `runs`; None when there are none, any failed, or no time
    passed."""
    if not runs or any(r.failed is not None for r in runs):
        return None
    return decode_rate(sum(r.decode_tokens for r in runs), sum(r.decode_s for r in runs))


def agreement(tokens: list[int], reference: list[int]) -> float:
    """Share of positions, up to the longer sequence, where both hold the same token."""
    length = max(len(tokens), len(reference))
    same = sum(a == b for a, b in zip(tokens, reference, strict=False))
    return same / length if length else 1.0


def with_agreement(runs: list[PromptRun], reference_mode: str) -> list[PromptRun]:
    reference = {
        (r.prompt_set, r.prompt_index): r.tokens
        for r in runs
        if r.mode == reference_mode and r.failed is None
    }
    out = []
    for r in runs:
        ref = reference.get((r.prompt_set, r.prompt_index))
        value = agreement(r.tokens, ref) if ref is not None and r.failed is None else None
        out.append(msgspec.structs.replace(r, agreement=value))
    return out


def summarise(mode: str, prompt_set: str, runs: list[PromptRun]) -> ModeSummary:
    """One mode on one prompt set, from the raw per-prompt figures. Any failed prompt makes
    the figures None: an average over the prompts that happened to work would mislead."""
    mine = [r for r in runs if r.mode == mode and r.prompt_set == prompt_set]
    failures = [r.failed for r in mine if r.failed is not None]
    ok = [r for r in mine if r.failed is None]
    peaks = [r.peak_rss_bytes for r in mine if r.peak_rss_bytes is not None]
    cgroup_peaks = [r.cgroup_peak_bytes for r in mine if r.cgroup_peak_bytes is not None]
    memory: dict[str, Any] = {  # ModeSummary's keywords
        "peak_rss_bytes": max(peaks) if peaks else None,
        "cgroup_peak_bytes": max(cgroup_peaks) if cgroup_peaks else None,
    }
    if failures or not ok:
        return ModeSummary(
            mode=mode,
            prompt_set=prompt_set,
            prompts=len(ok),
            failed=failures[0] if failures else "no prompts ran",
            **memory,
        )
    tokens = sum(r.new_tokens for r in ok)
    seconds = sum(r.first_token_s + r.decode_s for r in ok)
    agreements = [r.agreement for r in ok if r.agreement is not None]
    return ModeSummary(
        mode=mode,
        prompt_set=prompt_set,
        prompts=len(ok),
        decode_tok_s=pooled_decode_rate(ok),
        mean_first_token_s=sum(r.first_token_s for r in ok) / len(ok),
        agreement=sum(agreements) / len(agreements) if agreements else None,
        mean_accepted=per_step(tokens, sum(r.steps for r in ok)),
        bytes_per_token=sum(r.bytes_read for r in ok) / tokens,
        effective_bandwidth=sum(r.bytes_read for r in ok) / seconds if seconds > 0 else None,
        **memory,
    )


def compute_summary(
    modes: Sequence[ModeInfo], runs: Sequence[PromptRun], budget: str | None = None
) -> Summary:
    """Compare at `budget` (default: the first budget of any mode). Per prompt set: lever
    vs flash-AR, vs the fastest SD mode on that set, vs memory-resident AR, vs the faster
    transformers peer that worked, and vs the faster llama.cpp mode. A ratio whose modes
    are absent or failed is left out."""
    limit = next((m.limit for m in modes if m.limit is not None), None)
    if limit is not None:
        budget = None  # under --limits each mode has the budget that fits
    elif budget is None:
        budget = next((m.budget for m in modes if m.budget is not None), None)
    prompt_sets = list(dict.fromkeys(r.prompt_set for r in runs))

    def rate(mode: str, prompt_set: str) -> float | None:
        return pooled_decode_rate(
            [r for r in runs if r.mode == mode and r.prompt_set == prompt_set]
        )

    def at_budget(families: Sequence[str]) -> list[str]:
        """Modes of these families at the point compared: the budget, or the limit."""
        point = (lambda m: m.limit == limit) if limit else (lambda m: m.budget == budget)
        return [m.name for m in modes if m.family in families and point(m)]

    lever = next(iter(at_budget(["lever"])), None)
    per_set: dict[str, Ratios] = {}
    compared: dict[str, dict[str, str]] = {}
    for prompt_set in prompt_sets:
        lever_rate = rate(lever, prompt_set) if lever else None
        if lever is None or lever_rate is None:
            continue
        baselines = {
            "flash_ar": _fastest(at_budget(["flash-ar"]), prompt_set, rate),
            "best_sd": _fastest(at_budget(SD_FAMILIES), prompt_set, rate),
            "memory_ar": _fastest(
                [m.name for m in modes if m.family == "memory-ar"], prompt_set, rate
            ),
            "peer": _fastest(at_budget(OFFLOADED_PEERS), prompt_set, rate),
            # llama.cpp holds no DRAM budget of ours: the faster of its modes, at any
            # budget (under the limit compared, with --limits)
            "llamacpp": _fastest(
                [
                    m.name
                    for m in modes
                    if m.family in LLAMACPP_FAMILIES and (limit is None or m.limit == limit)
                ],
                prompt_set,
                rate,
            ),
        }
        ratios = {
            f"lever_vs_{key}": lever_rate / found[1]
            for key, found in baselines.items()
            if found is not None
        }
        per_set[prompt_set] = Ratios(**ratios)
        compared[prompt_set] = {"lever": lever} | {
            key: found[0] for key, found in baselines.items() if found is not None
        }
    means = {}
    for key in BASELINES:
        values = [getattr(r, f"lever_vs_{key}") for r in per_set.values()]
        values = [v for v in values if v is not None]
        if values:
            means[f"lever_vs_{key}"] = sum(values) / len(values)
    return Summary(budget=budget, limit=limit, per_prompt_set=per_set, compared=compared, **means)


def limit_summary(
    summary: Summary,
    modes: Sequence[ModeInfo],
    runs: Sequence[PromptRun],
    summaries: Sequence[ModeSummary],
    reference: str,
) -> Summary:
    """`summary` with the --limits figures: per limit, Lever, flash-AR, the best SD mode and
    the faster llama.cpp mode (decode tok/s over all prompt sets), Lever's decode plan and
    peak, and every mode's peaks (from its `summaries`); the memory-resident rates; Lever
    under 3 GiB over memory-resident AR; the idle Lever engine's RssAnon and RssFile at the
    largest limit that measured them; the lowest agreement of our modes with `reference`."""

    def rate(name: str) -> float | None:
        return pooled_decode_rate([r for r in runs if r.mode == name])

    def lever_at(limit: str) -> ModeInfo | None:
        return next((m for m in modes if m.limit == limit and m.family == "lever"), None)

    def peak_gib(mode: ModeInfo | None) -> float | None:
        """A mode's highest peak over the prompt sets, its process's or its cgroup's, in GiB."""
        values = [
            value
            for s in summaries
            if mode is not None and s.mode == mode.name
            for value in (s.peak_rss_bytes, s.cgroup_peak_bytes)
            if value is not None
        ]
        return max(values) / 2**30 if values else None

    def fastest(limit: str | None, families: Sequence[str]) -> float | None:
        rates = [rate(m.name) for m in modes if m.limit == limit and m.family in families]
        found = [r for r in rates if r is not None]
        return max(found) if found else None

    def peaks_gib(limit: str, field: str) -> dict[str, float]:
        """Mode -> its highest `field` (bytes) over the prompt sets, in GiB."""
        out: dict[str, float] = {}
        for s in summaries:
            value = getattr(s, field)
            if value and any(m.name == s.mode and m.limit == limit for m in modes):
                out[s.mode] = max(out.get(s.mode, 0.0), value / 2**30)
        return out

    limits = list(dict.fromkeys(m.limit for m in modes if m.limit is not None))
    figures = {
        limit: LimitFigures(
            lever=fastest(limit, ("lever",)),
            plain=fastest(limit, PLAIN_FAMILIES),
            flash_ar=fastest(limit, ("flash-ar",)),
            best_sd=fastest(limit, SD_FAMILIES),
            llamacpp_best=fastest(limit, LLAMACPP_FAMILIES),
            plan=getattr(lever_at(limit), "plan", None),
            peak_gib=peak_gib(lever_at(limit)),
            peak_rss_gib=peaks_gib(limit, "peak_rss_bytes"),
            cgroup_peak_gib=peaks_gib(limit, "cgroup_peak_bytes"),
        )
        for limit in limits
    }
    memory_ar = fastest(None, ("memory-ar",))
    # the figure: Lever under 3 GiB, where every layer fits, over one token a pass
    at_3gib = next((f.lever for k, f in figures.items() if parse_bytes(k) == 3 * 2**30), None)
    over_memory_ar = at_3gib / memory_ar if at_3gib is not None and memory_ar else None
    return msgspec.structs.replace(
        summary,
        limits=figures,
        min_agreement=_lowest_agreement(modes, runs, reference),
        # the memory-resident modes run once, without a limit
        memory_ar_quantized=memory_ar,
        memory_ar_bf16=fastest(None, ("memory-ar-dense",)),
        lever_over_memory_ar_3gib=over_memory_ar,
        idle_rss_mib=_idle_rss_mib(modes),
    )


def _lowest_agreement(
    modes: Sequence[ModeInfo], runs: Sequence[PromptRun], reference: str
) -> float | None:
    """The lowest agreement with `reference` of our modes (not llama.cpp's, not dequantized)."""
    ours = {m.name for m in modes if m.family not in (*LLAMACPP_FAMILIES, "memory-ar-dense")}
    agreements = [
        r.agreement for r in runs if r.mode in ours - {reference} and r.agreement is not None
    ]
    return min(agreements) if agreements else None


def _idle_rss_mib(modes: Sequence[ModeInfo]) -> dict[str, float]:
    """{"anon": MiB, "file": MiB}: the idle Lever engine's RssAnon and RssFile, from its
    child at the largest limit that measured them (there the kernel had the least cause to
    drop its file pages); {} where none did."""
    measured = [
        (parse_bytes(m.limit), m.idle_anon_rss_bytes, m.idle_file_rss_bytes)
        for m in modes
        if m.family == "lever"
        and m.limit is not None
        and m.idle_anon_rss_bytes is not None
        and m.idle_file_rss_bytes is not None
    ]
    if not measured:
        return {}
    _, anon, file = max(measured)
    return {"anon": anon / 2**20, "file": file / 2**20}


def _fastest(names: Sequence[str], prompt_set: str, rate) -> tuple[str, float] | None:
    rated = [(name, rate(name, prompt_set)) for name in names]
    rated = [(name, r) for name, r in rated if r is not None and r > 0]
    return max(rated, key=lambda item: item[1]) if rated else None


def sweep_rates(
    results: SweepResults,
) -> dict[tuple[str, str], dict[str, tuple[float | None, str | None, str | None]]]:
    """(throttle, budget) -> line -> (decode tok/s over all prompt sets, mode, failure).
    For "best SD" the mode is the fastest SD mode at that point."""
    out = {}
    for point in results.points:
        r = point.results
        row: dict[str, tuple[float | None, str | None, str | None]] = {}
        for line, families in _LINE_FAMILIES.items():
            candidates = []
            failure = None
            for info in r.modes:
                if info.family not in families:
                    continue
                runs = [x for x in r.runs if x.mode == info.name]
                failed = next((x.failed for x in runs if x.failed is not None), None)
                failure = failure or failed
                rate = pooled_decode_rate(runs)
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
    """The point's DRAM budget as a percentage of the target's weights."""
    return 100.0 * point.budget_bytes / point.target_bytes
