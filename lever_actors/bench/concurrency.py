"""The concurrency benchmark (`bench --parallel`): N requests at once of real prompts
(the prompt sets mixed), under each memory limit, on ours and on llama.cpp's server.

Ours is one engine per limit and N, opened with `EngineConfig.parallel=N` and otherwise as
`bench --limits` opens Lever (dram_budget auto, plan auto), in a child under the limit
(bench/child.py); its N requests are N streams started together (bench/together.py). The
peer is `llama-server -np N`, without and with its draft model, under the same limit
(bench/llamaserver.py). Every server is started afresh for each limit and N, its files
evicted from the page cache first, and stopped after it.

Each N decodes the same prompts, in rounds of N different ones (every prompt at least
once), so that every N does the same work; the figures are bench/concurrency_summary.py's.
Ours with N > 1 then takes the longest prompt while N-1 others decode (bench/joining.py).
"""

from __future__ import annotations

import functools
import os
import shlex
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import msgspec
import trio

from lever_actors.bench.child import ChildMode
from lever_actors.bench.concurrency_summary import (
    OURS,
    aggregate_tok_s,
    concurrency_summary,
    request_run,
    round_of,
    with_agreement,
    with_figures,
)
from lever_actors.bench.harness import PromptSet, Workload
from lever_actors.bench.isolation import CgroupSupport, MemoryCgroup, evict_from_page_cache
from lever_actors.bench.joining import joining_figures, run_joining
from lever_actors.bench.llamacpp import LlamaCppSpec, context_size, gguf_eos_id, process_peak_rss
from lever_actors.bench.llamacpp_build import SERVER
from lever_actors.bench.llamaserver import (
    Completion,
    complete_together,
    free_port,
    running_server,
    server_command,
)
from lever_actors.bench.mode import describe
from lever_actors.bench.plan import BenchOptions, plan_llamacpp, plan_modes
from lever_actors.bench.results import (
    ConcurrencyResults,
    ConcurrencyRun,
    Joining,
    Machine,
    Round,
)
from lever_actors.bench.specs import EngineSpec, PlannedMode
from lever_actors.bench.together import DecodesTogether, Together
from lever_actors.sizes import compact_bytes, parse_bytes

# llama-server's two runs: family of the spec it is planned as (llamacpp-spec: with the draft)
SERVER_FAMILIES = {"llama-server": "llamacpp-ar", "llama-server-draft": "llamacpp-spec"}


@dataclass(frozen=True)
class Prompt:
    prompt_set: str
    index: int  # in its prompt set
    tokens: list[int]


def mixed_prompts(prompt_sets: Sequence[PromptSet]) -> list[Prompt]:
    """The prompt sets' prompts taken in turn (a HumanEval one, a ShareGPT one, ...)."""
    longest = max((len(s.prompts) for s in prompt_sets), default=0)
    return [
        Prompt(s.name, i, s.prompts[i])
        for i in range(longest)
        for s in prompt_sets
        if i < len(s.prompts)
    ]


def rounds_of(prompts: Sequence[Prompt], parallel: int) -> list[list[Prompt]]:
    """Rounds of `parallel` different prompts that take every prompt at least once: round r
    takes them from r * parallel on, wrapping around, so that every round is full."""
    if not 1 <= parallel <= len(prompts):
        raise ValueError(f"{parallel} requests at once need as many prompts ({len(prompts)})")
    count = -(-len(prompts) // parallel)
    return [
        [prompts[(r * parallel + i) % len(prompts)] for i in range(parallel)] for r in range(count)
    ]


def parallel_runs(
    options: BenchOptions, workload: Workload, cgroups: CgroupSupport | None, command: str, log
) -> ConcurrencyResults:
    """Ours and both llama-server runs at each limit and N of `options.parallel`, with their
    figures (`bench` in bench/run.py measures the disk around them and writes the files)."""
    runs = trio.run(functools.partial(_run_all, options, workload, cgroups, log))
    runs = with_agreement([with_figures(run) for run in runs])
    return ConcurrencyResults(
        machine=Machine.here(),
        command=command,
        config=options.as_config(),
        runs=runs,
        summary=concurrency_summary(runs),
    )


async def _run_all(
    options: BenchOptions, workload: Workload, cgroups: CgroupSupport | None, log
) -> list[ConcurrencyRun]:
    prompts = mixed_prompts(workload.prompt_sets)
    servers = {
        engine: plan_llamacpp(options, family, workload.target, workload.draft, program_name=SERVER)
        for engine, family in SERVER_FAMILIES.items()
    }
    eos_id = gguf_eos_id(Path(servers["llama-server"].model))
    started = time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {text}", file=log, flush=True)

    runs = []
    for limit in options.limits:
        for parallel in options.parallel:
            rounds = rounds_of(prompts, parallel)
            mode = ChildMode(parallel_lever(options, workload, limit, parallel), cgroups)
            say(f"{OURS} under {limit}, {parallel} at once: {len(rounds)} rounds")
            runs.append(await run_ours(mode, limit, parallel, rounds, options, workload))
            say(_outcome(runs[-1]))
            for engine, spec in servers.items():
                say(f"{engine} under {limit}, {parallel} at once")
                run = await run_server(
                    spec, engine, cgroups, limit, parallel, rounds, options.max_new_tokens, eos_id
                )
                runs.append(run)
                say(_outcome(run))
    return runs


def parallel_lever(
    options: BenchOptions, workload: Workload, limit: str, parallel: int
) -> PlannedMode:
    """Lever as `bench --limits` plans it under `limit`, its engine taking `parallel`
    requests at once."""
    one = msgspec.structs.replace(options, modes=("lever",), limits=(limit,), parallel=())
    (planned,) = plan_modes(one, workload.target, workload.draft)
    assert isinstance(planned.spec, EngineSpec)  # lever is an engine mode
    config = msgspec.structs.replace(planned.spec.config, parallel=parallel)
    info = msgspec.structs.replace(planned.info, name=f"lever x{parallel}@{planned.info.limit}")
    return PlannedMode(info, EngineSpec(config))


async def run_ours(
    mode: DecodesTogether,
    limit: str,
    parallel: int,
    rounds: list[list[Prompt]],
    options: BenchOptions,
    workload: Workload,
) -> ConcurrencyRun:
    """Our engine opened by `mode`, then each round's prompts decoded at once; with several
    at once, the longest prompt then joins the first round's others while they decode."""
    done: list[Together] = []
    joining: Joining | None = None
    failed = None
    async with AsyncExitStack() as stack:
        try:
            await mode.open(stack)
            for prompts in rounds:
                together = await mode.decode_together(
                    [p.tokens for p in prompts],
                    options.max_new_tokens,
                    workload.stop_ids,
                    options.sampling,
                )
                done.append(together)
            if parallel > 1:
                joining = await _joining(mode, rounds, done[0], options, workload)
        except Exception as e:  # the run is recorded as failed with this text
            failed = describe(e)
    info = mode.info
    return ConcurrencyRun(
        engine=OURS,
        limit=compact_bytes(parse_bytes(limit)),
        parallel=parallel,
        rounds=[_our_round(p, t) for p, t in zip(rounds, done, strict=False)],
        peak_rss_bytes=_highest(t.peak_rss_bytes for t in done),
        cgroup_peak_bytes=_highest(t.cgroup_peak_bytes for t in done),
        memory_limit_bytes=info.memory_limit_bytes,
        limit_enforced=info.limit_enforced,
        plan=info.plan,
        budget_bytes=info.budget_bytes,
        joining=joining,
        failed=failed,
    )


async def _joining(
    mode: DecodesTogether,
    rounds: list[list[Prompt]],
    first_round: Together,
    options: BenchOptions,
    workload: Workload,
) -> Joining:
    """The longest prompt joining the first round's others (bench/joining.py)."""
    prompt = max((p for prompts in rounds for p in prompts), key=lambda p: len(p.tokens))
    running = [p.tokens for p in rounds[0][:-1]]
    alone_s, busy = await run_joining(
        mode,
        running,
        first_round,
        prompt.tokens,
        options.max_new_tokens,
        workload.stop_ids,
        options.sampling,
    )
    return joining_figures(prompt.prompt_set, prompt.index, len(prompt.tokens) - 2, alone_s, busy)


def _our_round(prompts: list[Prompt], together: Together) -> Round:
    start = min(together.started)
    return round_of(
        [
            request_run(
                p.prompt_set,
                p.index,
                len(p.tokens),
                d.tokens,
                d.stamps,
                d.first_step_tokens,
                started,
                ended,
                start,
            )
            for p, d, started, ended in zip(
                prompts, together.decoded, together.started, together.ended, strict=True
            )
        ]
    )


async def run_server(
    spec: LlamaCppSpec,
    engine: str,
    cgroups: CgroupSupport | None,
    limit: str,
    parallel: int,
    rounds: list[list[Prompt]],
    max_new_tokens: int,
    eos_id: int | None,
) -> ConcurrencyRun:
    """llama-server with `parallel` slots under `limit` (in a cgroup where `cgroups` allow),
    each round's prompts sent at once; stopped at the end. `eos_id` stands for the end
    token it stops at and does not return."""
    limit_bytes = parse_bytes(limit)
    run = ConcurrencyRun(
        engine=engine,
        limit=compact_bytes(limit_bytes),
        parallel=parallel,
        memory_limit_bytes=limit_bytes,
    )
    if spec.unavailable:
        return msgspec.structs.replace(run, failed=f"unavailable: {spec.unavailable}")
    longest = max(len(p.tokens) for prompts in rounds for p in prompts)
    port = free_port()
    argv = server_command(
        spec, port, parallel, context_size(longest, max_new_tokens, spec.draft_max)
    )
    cgroup = None
    if cgroups is not None and cgroups.usable:
        name = f"lever-bench-{os.getpid()}-{engine}-{parallel}"
        cgroup = MemoryCgroup(cgroups, name, limit_bytes)
    done: list[Round] = []
    peak = failed = None
    try:
        evict_from_page_cache([Path(p) for p in (spec.model, spec.draft) if p])
        async with running_server(argv, port, cgroup) as process:
            for prompts in rounds:
                answers = await complete_together(port, [p.tokens for p in prompts], max_new_tokens)
                done.append(_server_round(prompts, answers, eos_id))
            peak = process_peak_rss(process.pid)  # its high-water mark, before it stops
    except Exception as e:  # the run is recorded as failed with this text
        failed = describe(e)
    finally:
        cgroup_peak = cgroup.peak_bytes() if cgroup is not None else None
        if cgroup is not None:
            cgroup.remove()
    return msgspec.structs.replace(
        run,
        rounds=done,
        peak_rss_bytes=peak,
        cgroup_peak_bytes=cgroup_peak,
        memory_limit_bytes=cgroup.limit_bytes if cgroup is not None else limit_bytes,
        limit_enforced=cgroup is not None,
        command=shlex.join(argv),
        failed=failed,
    )


def _server_round(prompts: list[Prompt], answers: list[Completion], eos_id: int | None) -> Round:
    start = min(a.started for a in answers)
    requests = []
    for p, a in zip(prompts, answers, strict=True):
        tokens, stamps = a.tokens, a.stamps
        if a.stop_type == "eos" and eos_id is not None and stamps:
            tokens, stamps = [*tokens, eos_id], [*stamps, stamps[-1]]  # ours count the end token
        reported: dict[str, float | int | str] = {**a.timings, "stop_type": a.stop_type or ""}
        requests.append(
            request_run(
                p.prompt_set,
                p.index,
                len(p.tokens),
                tokens,
                stamps,
                a.first_step_tokens,
                a.started,
                a.ended,
                start,
                reported,
            )
        )
    return round_of(requests)


def _highest(values) -> int | None:
    found = [v for v in values if v is not None]
    return max(found) if found else None


def _outcome(run: ConcurrencyRun) -> str:
    if run.failed is not None:
        return f"  FAILED: {run.failed}"
    rate = aggregate_tok_s(run.rounds)
    tokens = sum(r.new_tokens for round_ in run.rounds for r in round_.requests)
    return f"  {tokens} tokens, " + (f"{rate:.2f} tok/s aggregate" if rate else "no rate")
