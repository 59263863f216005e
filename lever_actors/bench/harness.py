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
from pathlib import Path

import msgspec

from lever_actors.bench.class_summary import class_figures
from lever_actors.bench.mode import Decoded, Mode, describe
from lever_actors.bench.results import BenchResults, Machine, PromptRun
from lever_actors.bench.summary import (
    compute_summary,
    limit_summary,
    summarise,
    with_agreement,
)
from lever_actors.device.memory import peak_rss_bytes
from lever_actors.model.sampling import GREEDY, Sampling


@dataclass
class PromptSet:
    name: str
    prompts: list[list[int]]  # token ids, chat template already applied


@dataclass(frozen=True)
class Workload:
    """What every mode decodes: the target, the draft, and prompts as token ids."""

    target: Path
    draft: Path | None
    prompt_sets: Sequence[PromptSet]
    stop_ids: frozenset[int]


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
    sampling: Sampling = GREEDY,
    log=None,
) -> BenchResults:
    """The first mode is the reference that agreement is measured against; `budget` is the
    one the summary compares at (default: the first budget among the modes). Every mode
    decodes with `sampling` (greedy by default)."""
    log = log or sys.stderr  # looked up now: tests and callers may replace it
    runner = _Runner(modes, max_new_tokens, stop_ids, sampling, log)
    if order == "sequential":
        for mode in modes:
            async with AsyncExitStack() as stack:
                await runner.open(mode, stack)
                for prompt_set in prompt_sets:
                    for index, prompt in enumerate(prompt_set.prompts):
                        await runner.decode(mode, prompt_set, index, prompt)
    elif order == "interleaved":
        # the modes of one memory limit at a time: every limit's children at once would
        # hold the sum of the limits
        for group in _by_limit(modes):
            async with AsyncExitStack() as stack:
                for mode in group:
                    await runner.open(mode, stack)
                for prompt_set in prompt_sets:
                    for index, prompt in enumerate(prompt_set.prompts):
                        for mode in group:
                            await runner.decode(mode, prompt_set, index, prompt)
    else:
        raise ValueError(f"order must be interleaved or sequential, not {order!r}")
    reference = modes[0].info.name
    runs = with_agreement(runner.runs, reference)
    infos = [mode.info for mode in modes]  # after open: isolation facts are known
    summaries = [summarise(m.name, s.name, runs) for s in prompt_sets for m in infos]
    summary = compute_summary(infos, runs, budget)
    if any(m.limit is not None for m in infos):
        summary = limit_summary(summary, infos, runs, summaries, reference)
        by_class = msgspec.structs.asdict(class_figures(infos, runs))
        summary = msgspec.structs.replace(summary, **by_class)
    return BenchResults(
        machine=Machine.here(),
        command=command,
        config=config,
        reference_mode=reference,
        modes=infos,
        runs=runs,
        summaries=summaries,
        summary=summary,
    )


class _Runner:
    def __init__(
        self, modes: Sequence[Mode], max_new_tokens: int, stop_ids, sampling: Sampling, log
    ) -> None:
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.sampling = sampling
        self.log = log
        self.runs: list[PromptRun] = []
        self.failed: dict[str, str] = {}  # mode name -> its first error
        self.started = time.monotonic()
        self.width = max(len(m.info.name) for m in modes)

    async def open(self, mode: Mode, stack: AsyncExitStack) -> None:
        name = mode.info.name
        self._say(f"opening {name}")
        own = await stack.enter_async_context(AsyncExitStack())
        try:
            await mode.open(own)
        except Exception as e:
            await own.aclose()
            self.failed[name] = describe(e)
            self._say(f"{name} FAILED to open: {self.failed[name]}")

    async def decode(self, mode: Mode, prompt_set: PromptSet, index: int, prompt: list[int]):
        name = mode.info.name
        where = f"{prompt_set.name} {index + 1}/{len(prompt_set.prompts)} {name:{self.width}}"
        if name not in self.failed:
            t0 = time.perf_counter()
            try:
                decoded = await mode.decode(
                    prompt, self.max_new_tokens, self.stop_ids, self.sampling
                )
            except Exception as e:
                self.failed[name] = describe(e)
                self._say(f"{where}: FAILED: {self.failed[name]}")
        if name in self.failed:
            self.runs.append(_failed_run(name, prompt_set.name, index, prompt, self.failed[name]))
            return
        if decoded.peak_rss_bytes is None:
            decoded.peak_rss_bytes = peak_rss_bytes()  # in process: the whole harness's
        run = prompt_run(name, prompt_set.name, index, prompt, t0, decoded)
        self.runs.append(run)
        rate = run.decode_tok_s
        self._say(
            f"{where}: {run.new_tokens} tokens, "
            + (f"{rate:.2f} tok/s" if rate is not None else "no decode rate")
        )

    def _say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:7.1f}s] {text}", file=self.log, flush=True)


def _by_limit(modes: Sequence[Mode]) -> list[list[Mode]]:
    """The modes grouped by the memory limit they run under, in their order of first use."""
    groups: dict[str | None, list[Mode]] = {}
    for mode in modes:
        groups.setdefault(mode.info.limit, []).append(mode)
    return list(groups.values())


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
        reported=decoded.reported,
    )
