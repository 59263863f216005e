"""Runs decoding modes on identical prompts and summarises them.

Interleaved (the default): every mode is open at once and they take turns on each prompt,
so that drift of the machine hits every mode alike. Sequential: one mode at a time over all
prompts, so that only one mode's memory is held at once. A mode that fails to open or to
decode is reported as failed, with the error, on every prompt it did not decode.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass

import msgspec

from lever_actors.bench.isolation import peak_rss_bytes
from lever_actors.bench.modes import Decoded, Mode
from lever_actors.bench.results import BenchResults, Machine, ModeSummary, PromptRun
from lever_actors.bench.summary import compute_summary, decode_rate


@dataclass
class PromptSet:
    name: str
    prompts: list[list[int]]  # token ids, chat template already applied


async def run_bench(
    modes: Sequence[Mode],
    prompt_sets: Sequence[PromptSet],
    *,
    max_new_tokens: int,
    stop_ids: frozenset[int],
    config: dict[str, object],
    command: str = "",
    order: str = "interleaved",
    budget: str | None = None,
    log=None,
) -> BenchResults:
    """The first mode is the reference that agreement is measured against; `budget` is the
    one the summary compares at (default: the first budget among the modes)."""
    log = log or sys.stderr  # looked up now: tests and callers may replace it
    runner = _Runner(modes, max_new_tokens, stop_ids, log)
    if order == "sequential":
        for mode in modes:
            async with AsyncExitStack() as stack:
                await runner.open(mode, stack)
                for prompt_set in prompt_sets:
                    for index, prompt in enumerate(prompt_set.prompts):
                        await runner.decode(mode, prompt_set, index, prompt)
    elif order == "interleaved":
        async with AsyncExitStack() as stack:
            for mode in modes:
                await runner.open(mode, stack)
            for prompt_set in prompt_sets:
                for index, prompt in enumerate(prompt_set.prompts):
                    for mode in modes:
                        await runner.decode(mode, prompt_set, index, prompt)
    else:
        raise ValueError(f"order must be interleaved or sequential, not {order!r}")
    runs = with_agreement(runner.runs, modes[0].name)
    infos = [mode.info for mode in modes]  # after open: isolation facts are known
    summaries = [summarise(mode.name, s.name, runs) for s in prompt_sets for mode in modes]
    return BenchResults(
        machine=Machine.here(),
        command=command,
        config=config,
        reference_mode=modes[0].name,
        modes=infos,
        runs=runs,
        summaries=summaries,
        summary=compute_summary(infos, runs, budget),
    )


class _Runner:
    def __init__(self, modes: Sequence[Mode], max_new_tokens: int, stop_ids, log) -> None:
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.log = log
        self.runs: list[PromptRun] = []
        self.failed: dict[str, str] = {}
        self.started = time.monotonic()
        self.width = max(len(m.name) for m in modes)

    async def open(self, mode: Mode, stack: AsyncExitStack) -> None:
        self._say(f"opening {mode.name}")
        own = await stack.enter_async_context(AsyncExitStack())
        try:
            await mode.open(own)
        except Exception as e:
            await own.aclose()
            self.failed[mode.name] = _describe(e)
            self._say(f"{mode.name} FAILED to open: {self.failed[mode.name]}")

    async def decode(self, mode: Mode, prompt_set: PromptSet, index: int, prompt: list[int]):
        where = f"{prompt_set.name} {index + 1}/{len(prompt_set.prompts)} {mode.name:{self.width}}"
        if mode.name in self.failed:
            self.runs.append(
                _failed_run(mode.name, prompt_set.name, index, prompt, self.failed[mode.name])
            )
            return
        t0 = time.perf_counter()
        try:
            decoded = await mode.decode(prompt, self.max_new_tokens, self.stop_ids)
        except Exception as e:
            self.failed[mode.name] = _describe(e)
            self.runs.append(
                _failed_run(mode.name, prompt_set.name, index, prompt, self.failed[mode.name])
            )
            self._say(f"{where}: FAILED: {self.failed[mode.name]}")
            return
        if decoded.peak_rss_bytes is None:
            decoded.peak_rss_bytes = peak_rss_bytes()  # in process: the whole harness's
        run = prompt_run(mode.name, prompt_set.name, index, prompt, t0, decoded)
        self.runs.append(run)
        rate = run.decode_tok_s
        self._say(
            f"{where}: {run.new_tokens} tokens, "
            + (f"{rate:.2f} tok/s" if rate is not None else "no decode rate")
        )

    def _say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:7.1f}s] {text}", file=self.log, flush=True)


def _describe(error: Exception) -> str:
    text = (
        str(error) if type(error).__name__ == "ModeFailed" else f"{type(error).__name__}: {error}"
    )
    return text if len(text) <= 500 else text[:497] + "..."


def _failed_run(mode: str, prompt_set: str, index: int, prompt: list[int], error: str) -> PromptRun:
    return PromptRun(
        mode=mode,
        prompt_set=prompt_set,
        prompt_index=index,
        prompt_tokens=len(prompt),
        new_tokens=0,
        first_token_s=0.0,
        decode_s=0.0,
        agreement=None,
        tokens=[],
        failed=error,
    )


def prompt_run(
    mode: str, prompt_set: str, index: int, prompt: list[int], t0: float, decoded: Decoded
) -> PromptRun:
    if not decoded.tokens:
        return _failed_run(mode, prompt_set, index, prompt, "no token was generated")
    first_step = min(max(decoded.first_step_tokens, 1), len(decoded.tokens))
    return PromptRun(
        mode=mode,
        prompt_set=prompt_set,
        prompt_index=index,
        prompt_tokens=len(prompt),
        new_tokens=len(decoded.tokens),
        first_token_s=decoded.stamps[0] - t0,
        decode_s=decoded.stamps[-1] - decoded.stamps[first_step - 1],
        agreement=None,  # filled in once the reference has run
        tokens=decoded.tokens,
        bytes_read=decoded.bytes_read,
        steps=decoded.steps,
        first_step_tokens=first_step,
        peak_rss_bytes=decoded.peak_rss_bytes,
        cgroup_peak_bytes=decoded.cgroup_peak_bytes,
    )


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


def agreement(tokens: list[int], reference: list[int]) -> float:
    """Share of positions, up to the longer sequence, where both hold the same token."""
    length = max(len(tokens), len(reference))
    same = sum(a == b for a, b in zip(tokens, reference, strict=False))
    return same / length if length else 1.0


def summarise(mode: str, prompt_set: str, runs: list[PromptRun]) -> ModeSummary:
    """One mode on one prompt set, from the raw per-prompt figures. Any failed prompt makes
    the figures None: an average over the prompts that happened to work would mislead."""
    mine = [r for r in runs if r.mode == mode and r.prompt_set == prompt_set]
    failures = [r.failed for r in mine if r.failed is not None]
    ok = [r for r in mine if r.failed is None]
    peaks = [r.peak_rss_bytes for r in mine if r.peak_rss_bytes is not None]
    cgroup_peaks = [r.cgroup_peak_bytes for r in mine if r.cgroup_peak_bytes is not None]
    memory = {
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
    steps = sum(r.steps for r in ok)
    seconds = sum(r.first_token_s + r.decode_s for r in ok)
    agreements = [r.agreement for r in ok if r.agreement is not None]
    return ModeSummary(
        mode=mode,
        prompt_set=prompt_set,
        prompts=len(ok),
        decode_tok_s=decode_rate(ok),
        mean_first_token_s=sum(r.first_token_s for r in ok) / len(ok),
        agreement=sum(agreements) / len(agreements) if agreements else None,
        mean_accepted=tokens / steps if steps else None,
        bytes_per_token=sum(r.bytes_read for r in ok) / tokens,
        effective_bandwidth=sum(r.bytes_read for r in ok) / seconds if seconds > 0 else None,
        **memory,
    )
