"""The figures of the concurrency benchmark, from raw per-request times: each request's
record, a round's wall time, the aggregate decode rate, agreement with each request's own
sequential run, and the summary. Nothing here runs a model or a server.

The aggregate: every new token of a run's rounds over the sum of the rounds' wall times,
each from its first request's start to its last one's end (prefills and first tokens
included). Ours and llama-server's are computed alike, here, by `aggregate_tok_s`."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from lever_actors.bench.results import ConcurrencyRun, ConcurrencySummary, RequestRun, Round
from lever_actors.bench.summary import agreement
from lever_actors.channels.stats import decode_rate
from lever_actors.sizes import parse_bytes

OURS = "lever"
SERVERS = ("llama-server", "llama-server-draft")  # llama.cpp's server without, with its draft
ENGINES = (OURS, *SERVERS)


def request_run(
    prompt_set: str,
    prompt_index: int,
    prompt_tokens: int,
    tokens: list[int],
    stamps: Sequence[float],
    first_step_tokens: int,
    started: float,
    ended: float,
    round_start: float,
    reported: dict[str, float | int | str] | None = None,
) -> RequestRun:
    """One request from its token arrival times (`stamps`, one per token) and when it started
    and ended, all on one clock; `first_step_tokens` came with the first, before decoding."""
    first = min(max(first_step_tokens, 1), len(tokens))
    return RequestRun(
        prompt_set=prompt_set,
        prompt_index=prompt_index,
        prompt_tokens=prompt_tokens,
        new_tokens=len(tokens),
        started_s=started - round_start,
        first_token_s=stamps[0] - started if stamps else ended - started,
        ended_s=ended - round_start,
        decode_tok_s=decode_rate(len(tokens) - first, stamps[-1] - stamps[first - 1])
        if stamps
        else None,
        tokens=list(tokens),
        reported=reported,
    )


def round_of(requests: list[RequestRun]) -> Round:
    """Requests sent together, timed from the first one's start to the last one's end."""
    wall = max(r.ended_s for r in requests) - min(r.started_s for r in requests)
    return Round(requests, wall)


def aggregate_tok_s(rounds: Sequence[Round]) -> float | None:
    """The aggregate decode rate: new tokens of every request over the rounds' wall time."""
    tokens = sum(r.new_tokens for round_ in rounds for r in round_.requests)
    return decode_rate(tokens, sum(round_.wall_s for round_ in rounds))


def with_figures(run: ConcurrencyRun) -> ConcurrencyRun:
    """`run` with its aggregate and its requests' mean time to first token and decode rate;
    a failed run has none (the rounds before its failure alone would mislead)."""
    requests = [r for round_ in run.rounds for r in round_.requests]
    if not requests or run.failed is not None:
        return run
    rates = [r.decode_tok_s for r in requests if r.decode_tok_s is not None]
    return msgspec.structs.replace(
        run,
        aggregate_tok_s=aggregate_tok_s(run.rounds),
        mean_first_token_s=sum(r.first_token_s for r in requests) / len(requests),
        mean_request_decode_tok_s=sum(rates) / len(rates) if rates else None,
    )


def with_agreement(runs: Sequence[ConcurrencyRun]) -> list[ConcurrencyRun]:
    """Every request's agreement with its prompt's sequential run: ours with one request at a
    time under the same limit (its first run of that prompt)."""
    reference: dict[tuple[str, str, int], list[int]] = {}
    for run in runs:
        if run.engine == OURS and run.parallel == 1 and run.failed is None:
            for round_ in run.rounds:
                for r in round_.requests:
                    reference.setdefault((run.limit, r.prompt_set, r.prompt_index), r.tokens)

    def agreed(limit: str, r: RequestRun) -> RequestRun:
        ref = reference.get((limit, r.prompt_set, r.prompt_index))
        return msgspec.structs.replace(
            r, agreement=agreement(r.tokens, ref) if ref is not None else None
        )

    return [
        msgspec.structs.replace(
            run,
            rounds=[
                Round([agreed(run.limit, r) for r in round_.requests], round_.wall_s)
                for round_ in run.rounds
            ],
        )
        for run in runs
    ]


def concurrency_summary(runs: Sequence[ConcurrencyRun]) -> ConcurrencySummary:
    """The issue's ratios and every aggregate, from runs with their figures and agreement."""
    aggregates: dict[str, dict[str, dict[str, float | None]]] = {}
    for run in runs:
        by_engine = aggregates.setdefault(run.limit, {})
        by_engine.setdefault(run.engine, {})[str(run.parallel)] = run.aggregate_tok_s

    def rate(engines: Sequence[str], gib: int, parallel: int) -> float | None:
        """The best aggregate of `engines` under the limit of `gib` GiB."""
        found = [
            run.aggregate_tok_s
            for run in runs
            if run.engine in engines
            and run.parallel == parallel
            and parse_bytes(run.limit) == gib * 2**30
            and run.aggregate_tok_s is not None
        ]
        return max(found) if found else None

    def ratio(ours: float | None, theirs: float | None) -> float | None:
        return ours / theirs if ours is not None and theirs else None

    # each request at N > 1 against its own sequential run (N = 1 agrees with itself)
    agreements = [
        r.agreement
        for run in runs
        if run.engine == OURS and run.parallel > 1
        for round_ in run.rounds
        for r in round_.requests
        if r.agreement is not None
    ]
    joined = [run.joining for run in runs if run.engine == OURS and run.joining is not None]
    return ConcurrencySummary(
        aggregate_4_over_1_at_1gib=ratio(rate([OURS], 1, 4), rate([OURS], 1, 1)),
        aggregate_4_vs_llamacpp_server_1gib=ratio(rate([OURS], 1, 4), rate(SERVERS, 1, 4)),
        aggregate_4_vs_llamacpp_server_3gib=ratio(rate([OURS], 3, 4), rate(SERVERS, 3, 4)),
        aggregate_1_vs_llamacpp_server_3gib=ratio(rate([OURS], 3, 1), rate(SERVERS, 3, 1)),
        aggregate_8_vs_llamacpp_server_3gib=ratio(rate([OURS], 3, 8), rate(SERVERS, 3, 8)),
        ttft_joining_busy_over_alone=max(
            (j.first_token_busy_s / j.first_token_alone_s for j in joined), default=None
        ),
        joining_gap_over_step=max(
            (j.gap_s / j.step_s for j in joined if j.step_s and j.gap_s is not None), default=None
        ),
        min_agreement=min(agreements) if agreements else None,
        aggregates=aggregates,
    )
