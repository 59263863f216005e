"""The headline ratios: Lever's decode tok/s over each baseline's, from the raw per-prompt
figures, per prompt set and averaged over the prompt sets."""

from __future__ import annotations

from collections.abc import Sequence

from lever_actors.bench.results import ModeInfo, PromptRun, Ratios, Summary

SD_FAMILIES = ("sd-chain", "sd-static")
PEER_FAMILIES = ("peer-offload", "peer-assisted")
BASELINES = ("flash_ar", "best_sd", "memory_ar", "peer")


def decode_rate(runs: Sequence[PromptRun]) -> float | None:
    """Tokens of the decode phase (after the first step, which comes with the prefill) per
    second of decoding, over all `runs`; None when there are none, any failed, or no time
    passed."""
    if not runs or any(r.failed is not None for r in runs):
        return None
    tokens = sum(r.decode_tokens for r in runs)
    seconds = sum(r.decode_s for r in runs)
    return tokens / seconds if seconds > 0 and tokens > 0 else None


def compute_summary(
    modes: Sequence[ModeInfo], runs: Sequence[PromptRun], budget: str | None = None
) -> Summary:
    """Compare at `budget` (default: the first budget of any mode). Per prompt set: lever
    vs flash-AR, vs the fastest SD mode on that set, vs memory-resident AR, and vs the faster
    peer that worked. A ratio whose modes are absent or failed is left out."""
    if budget is None:
        budget = next((m.budget for m in modes if m.budget is not None), None)
    prompt_sets = list(dict.fromkeys(r.prompt_set for r in runs))

    def rate(mode: str, prompt_set: str) -> float | None:
        return decode_rate([r for r in runs if r.mode == mode and r.prompt_set == prompt_set])

    def at_budget(families: Sequence[str]) -> list[str]:
        return [m.name for m in modes if m.family in families and m.budget == budget]

    lever = next(iter(at_budget(["lever"])), None)
    per_set: dict[str, Ratios] = {}
    compared: dict[str, dict[str, str]] = {}
    for prompt_set in prompt_sets:
        lever_rate = rate(lever, prompt_set) if lever else None
        if lever_rate is None:
            continue
        baselines = {
            "flash_ar": _fastest(at_budget(["flash-ar"]), prompt_set, rate),
            "best_sd": _fastest(at_budget(SD_FAMILIES), prompt_set, rate),
            "memory_ar": _fastest(
                [m.name for m in modes if m.family == "memory-ar"], prompt_set, rate
            ),
            "peer": _fastest(at_budget(PEER_FAMILIES), prompt_set, rate),
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
    return Summary(budget=budget, per_prompt_set=per_set, compared=compared, **means)


def _fastest(names: Sequence[str], prompt_set: str, rate) -> tuple[str, float] | None:
    rated = [(name, rate(name, prompt_set)) for name in names]
    rated = [(name, r) for name, r in rated if r is not None and r > 0]
    return max(rated, key=lambda item: item[1]) if rated else None
