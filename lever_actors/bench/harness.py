"""Runs decoding modes on identical prompts, interleaved per prompt, and summarises them."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass

from lever_actors.bench.modes import Decoded, Mode
from lever_actors.bench.results import BenchResults, Machine, ModeSummary, PromptRun


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
    log=sys.stderr,
) -> BenchResults:
    """The first mode is the reference that agreement is measured against. Modes take turns
    on each prompt so that drift of the machine hits every mode alike."""
    runs: list[PromptRun] = []
    async with AsyncExitStack() as stack:
        for mode in modes:
            await mode.open(stack)
        started = time.monotonic()
        await _interleave(modes, prompt_sets, max_new_tokens, stop_ids, runs, started, log)
    summaries = [_summarise(mode.name, s.name, runs) for s in prompt_sets for mode in modes]
    return BenchResults(
        machine=Machine.here(),
        config=config,
        reference_mode=modes[0].name,
        runs=runs,
        summaries=summaries,
        ratios=_ratios([m.name for m in modes], runs),
    )


async def _interleave(modes, prompt_sets, max_new_tokens, stop_ids, runs, started, log) -> None:
    for prompt_set in prompt_sets:
        for index, prompt in enumerate(prompt_set.prompts):
            reference: list[int] | None = None
            for mode in modes:
                t0 = time.perf_counter()
                decoded = await mode.decode(prompt, max_new_tokens, stop_ids)
                reference = decoded.tokens if reference is None else reference
                runs.append(
                    _prompt_run(mode.name, prompt_set.name, index, prompt, t0, decoded, reference)
                )
                print(
                    f"[{time.monotonic() - started:7.1f}s] {prompt_set.name} {index + 1}/"
                    f"{len(prompt_set.prompts)} {mode.name}: {len(decoded.tokens)} tokens, "
                    f"{runs[-1].decode_tok_s:.2f} tok/s",
                    file=log,
                    flush=True,
                )


def _prompt_run(
    mode: str,
    prompt_set: str,
    index: int,
    prompt: list[int],
    t0: float,
    decoded: Decoded,
    reference: list[int],
) -> PromptRun:
    first = decoded.stamps[0] - t0
    decode = decoded.stamps[-1] - decoded.stamps[0]
    return PromptRun(
        mode=mode,
        prompt_set=prompt_set,
        prompt_index=index,
        prompt_tokens=len(prompt),
        new_tokens=len(decoded.tokens),
        first_token_s=first,
        decode_s=decode,
        agreement=agreement(decoded.tokens, reference),
        tokens=decoded.tokens,
        bytes_read=decoded.bytes_read,
        steps=decoded.steps,
    )


def agreement(tokens: list[int], reference: list[int]) -> float:
    """Share of positions, up to the longer sequence, where both hold the same token."""
    length = max(len(tokens), len(reference))
    same = sum(a == b for a, b in zip(tokens, reference, strict=False))
    return same / length if length else 1.0


def decode_rate(runs: Sequence[PromptRun]) -> float:
    tokens = sum(r.new_tokens - 1 for r in runs)
    seconds = sum(r.decode_s for r in runs)
    return tokens / seconds if seconds > 0 else float("nan")


def _summarise(mode: str, prompt_set: str, runs: list[PromptRun]) -> ModeSummary:
    mine = [r for r in runs if r.mode == mode and r.prompt_set == prompt_set]
    return ModeSummary(
        mode=mode,
        prompt_set=prompt_set,
        decode_tok_s=decode_rate(mine),
        mean_first_token_s=sum(r.first_token_s for r in mine) / len(mine),
        agreement=sum(r.agreement for r in mine) / len(mine),
        bytes_per_token=sum(r.bytes_read for r in mine) / sum(r.new_tokens for r in mine),
        mean_accepted=_mean_accepted(mine),
        effective_bandwidth=sum(r.bytes_read for r in mine)
        / sum(r.first_token_s + r.decode_s for r in mine),
    )


def _mean_accepted(runs: Sequence[PromptRun]) -> float:
    """New tokens per target pass; nan for modes without passes (memory AR, the peer)."""
    steps = sum(r.steps for r in runs)
    return sum(r.new_tokens for r in runs) / steps if steps else float("nan")


def _ratios(modes: list[str], runs: list[PromptRun]) -> dict[str, float]:
    rate = {m: decode_rate([r for r in runs if r.mode == m]) for m in modes}
    return {f"{a}_vs_{b}": rate[a] / rate[b] for a, b in itertools.permutations(modes, 2)}


def markdown_table(results: BenchResults) -> str:
    lines = [
        "| mode | prompt set | decode tok/s | first token s | tokens/step | agreement "
        "| MB read/token | effective GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in results.summaries:
        lines.append(
            f"| {s.mode} | {s.prompt_set} | {s.decode_tok_s:.2f} | {s.mean_first_token_s:.2f} "
            f"| {s.mean_accepted:.2f} | {100 * s.agreement:.1f}% | {s.bytes_per_token / 1e6:.1f} "
            f"| {s.effective_bandwidth / 1e9:.2f} |"
        )
    return "\n".join(lines)
