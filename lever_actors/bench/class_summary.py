"""The --limits figures by class of text (code, chat, prose): Lever on auto against
llama.cpp's best mode per class and limit, the worst single prompt, and the regret of
auto's plan against each plan forced."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from lever_actors.bench.plan import FORCED_PLANS
from lever_actors.bench.results import ModeInfo, PromptRun
from lever_actors.bench.summary import LLAMACPP_FAMILIES, pooled_decode_rate
from lever_actors.checkpoints.prompts import TEXT_CLASSES


class ClassFigures(msgspec.Struct, frozen=True, omit_defaults=True):
    # class -> limit -> Lever's decode rate over llama.cpp's best mode's, pooled per class
    classes: dict[str, dict[str, float]] = {}
    # the lowest of that ratio on one prompt (against the llama.cpp mode best on it)
    min_prompt_ratio: float | None = None
    # the highest (fastest forced plan / auto) on one prompt at one limit
    max_plan_regret: float | None = None


def class_figures(modes: Sequence[ModeInfo], runs: Sequence[PromptRun]) -> ClassFigures:
    """Per limit: Lever (auto) against llama.cpp's faster mode, by class and by prompt, and
    against each forced plan (FORCED_PLANS) by prompt. A failed or missing run is left out."""

    def rate(mode: str, prompts: set[tuple[str, int]]) -> float | None:
        return pooled_decode_rate(
            [r for r in runs if r.mode == mode and (r.prompt_set, r.prompt_index) in prompts]
        )

    def best(names: Sequence[str], prompts: set[tuple[str, int]]) -> float | None:
        rates = [x for x in (rate(name, prompts) for name in names) if x]
        return max(rates) if rates else None

    every = sorted({(r.prompt_set, r.prompt_index) for r in runs})
    classes: dict[str, dict[str, float]] = {}
    prompt_ratios: list[float] = []
    regrets: list[float] = []
    for limit in dict.fromkeys(m.limit for m in modes if m.limit is not None):
        here = [m for m in modes if m.limit == limit]
        lever = next((m.name for m in here if m.family == "lever"), None)
        if lever is None:
            continue
        peers = [m.name for m in here if m.family in LLAMACPP_FAMILIES]
        forced = [m.name for m in here if m.family in FORCED_PLANS]
        for prompt_set in dict.fromkeys(s for s, _ in every):
            prompts = {p for p in every if p[0] == prompt_set}
            ours, theirs = rate(lever, prompts), best(peers, prompts)
            if ours and theirs:
                kind = TEXT_CLASSES.get(prompt_set, prompt_set)
                classes.setdefault(kind, {})[limit] = ours / theirs
        for prompt in every:
            ours = rate(lever, {prompt})
            if not ours:
                continue
            theirs, fastest = best(peers, {prompt}), best(forced, {prompt})
            if theirs:
                prompt_ratios.append(ours / theirs)
            if fastest:
                regrets.append(max(fastest / ours, 1.0))
    return ClassFigures(
        classes=classes,
        min_prompt_ratio=min(prompt_ratios, default=None),
        max_plan_regret=max(regrets, default=None),
    )
