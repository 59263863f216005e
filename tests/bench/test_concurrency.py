"""bench --parallel: the aggregate's definition, agreement with each request's sequential
run, the summary's ratios, rounds of prompts, llama-server's command line and its HTTP
driver against a stand-in server (tests/bench/fake_llama_server.py), our side through a
fake mode and, once, through a child on the tiny pair; results to JSON, markdown and PNG."""

from __future__ import annotations

import stat
import sys
import threading
import time
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import pytest
import trio
from PIL import Image

from lever_actors.bench import plots
from lever_actors.bench import run as bench_run
from lever_actors.bench.child import ChildMode
from lever_actors.bench.concurrency import (
    Prompt,
    mixed_prompts,
    parallel_lever,
    rounds_of,
    run_ours,
    run_server,
)
from lever_actors.bench.concurrency_summary import (
    aggregate_tok_s,
    concurrency_summary,
    request_run,
    round_of,
    with_agreement,
    with_figures,
)
from lever_actors.bench.harness import PromptSet, Workload
from lever_actors.bench.isolation import probe_cgroup
from lever_actors.bench.llamacpp import LlamaCppSpec
from lever_actors.bench.llamaserver import complete_together, healthy, server_command
from lever_actors.bench.mode import ModeFailed
from lever_actors.bench.plan import BenchOptions
from lever_actors.bench.report import output_paths, render_markdown
from lever_actors.bench.results import (
    ConcurrencyResults,
    ConcurrencyRun,
    Joining,
    Machine,
    ModeInfo,
    RequestRun,
    Round,
    read_results,
)
from lever_actors.bench.run import write_outputs
from lever_actors.bench.together import Together, decode_together
from lever_actors.cli.bench import options_from_args
from lever_actors.errors import ConfigError
from lever_actors.model.sampling import GREEDY
from tests.bench import fake_llama_server
from tests.bench.fake_llama_server import DIE, EOS, FakeServer, reply
from tests.bench.fakes import FakeMode

SUPPORT = probe_cgroup()
PROMPTS = [Prompt("humaneval", 0, [1, 2]), Prompt("sharegpt", 0, [3, 4, 5])]


def _request(
    started: float, ended: float, tokens: int = 4, first: float | None = None
) -> RequestRun:
    first = started + 0.5 if first is None else first
    stamps = [first + i * (ended - first) / max(tokens - 1, 1) for i in range(tokens)]
    return request_run("s", 0, 3, list(range(tokens)), stamps, 1, started, ended, 0.0)


# --- the figures ------------------------------------------------------------------------


def test_aggregate_is_every_new_token_over_each_rounds_first_start_to_last_end():
    # round 1: two requests, one sent 1 s after the other, the first ending last
    one = round_of([_request(10.0, 14.0, tokens=6), _request(11.0, 13.0, tokens=2)])
    assert one.wall_s == pytest.approx(4.0)
    two = round_of([_request(20.0, 26.0, tokens=4), _request(20.0, 21.0, tokens=0)])
    assert two.wall_s == pytest.approx(6.0)
    assert aggregate_tok_s([one, two]) == pytest.approx((6 + 2 + 4 + 0) / (4.0 + 6.0))
    assert aggregate_tok_s([]) is None


def test_a_request_times_its_first_token_and_its_decode_after_the_first_arrival():
    # three tokens came with the first step (1.5 s after the request), then two, 1 s apart
    stamps = [11.5, 11.5, 11.5, 12.5, 13.5]
    r = request_run("humaneval", 2, 9, [5, 6, 7, 8, 9], stamps, 3, 10.0, 13.6, 9.0)
    assert (r.started_s, r.first_token_s, r.ended_s) == pytest.approx((1.0, 1.5, 4.6))
    assert r.decode_tok_s == pytest.approx(2 / 2.0)
    assert (r.new_tokens, r.prompt_tokens, r.prompt_set, r.prompt_index) == (5, 9, "humaneval", 2)


def _run(engine: str, limit: str, parallel: int, rate: float | None, **fields) -> ConcurrencyRun:
    return ConcurrencyRun(
        engine=engine, limit=limit, parallel=parallel, aggregate_tok_s=rate, **fields
    )


def test_summary_ratios_take_the_better_server_at_four_slots():
    runs = [
        _run("lever", "1GiB", 1, 8.0),
        _run("lever", "1GiB", 4, 24.0),
        _run("llama-server", "1GiB", 4, 2.0),
        _run("llama-server-draft", "1GiB", 4, 3.0),
        _run("lever", "3GiB", 1, 20.0),
        _run("llama-server", "3GiB", 1, 16.0),
        _run("lever", "3GiB", 4, 30.0),
        _run("llama-server", "3GiB", 4, 40.0),
        _run("llama-server-draft", "3GiB", 4, None, failed="killed by the memory limit"),
        _run("lever", "3GiB", 8, 45.0),
        _run("llama-server-draft", "3GiB", 8, 30.0),
    ]
    s = concurrency_summary(runs)
    assert s.aggregate_4_over_1_at_1gib == pytest.approx(3.0)
    assert s.aggregate_4_vs_llamacpp_server_1gib == pytest.approx(8.0)
    assert s.aggregate_4_vs_llamacpp_server_3gib == pytest.approx(0.75)
    assert s.aggregate_1_vs_llamacpp_server_3gib == pytest.approx(1.25)
    assert s.aggregate_8_vs_llamacpp_server_3gib == pytest.approx(1.5)
    assert s.aggregates["1GiB"]["lever"] == {"1": 8.0, "4": 24.0}
    assert s.aggregates["3GiB"]["llama-server-draft"] == {"4": None, "8": 30.0}
    names = msgspec.to_builtins(s)
    assert {
        "aggregate_4_over_1_at_1GiB",
        "aggregate_4_vs_llamacpp_server_1GiB",
        "aggregate_4_vs_llamacpp_server_3GiB",
        "aggregate_1_vs_llamacpp_server_3GiB",
        "aggregate_8_vs_llamacpp_server_3GiB",
        "min_agreement",
    } <= set(names)
    # without a 4 or a 1 GiB run the ratios are absent, not guessed
    missing = concurrency_summary([_run("lever", "3GiB", 1, 20.0)])
    assert missing.aggregate_4_over_1_at_1gib is None
    assert missing.aggregate_4_vs_llamacpp_server_3gib is None


def _tokens_run(engine: str, limit: str, parallel: int, tokens: dict[int, list[int]]):
    requests = [
        request_run("s", i, 3, t, [1.0 + j for j in range(len(t))], 1, 0.0, 9.0, 0.0)
        for i, t in tokens.items()
    ]
    return ConcurrencyRun(
        engine=engine, limit=limit, parallel=parallel, rounds=[round_of(requests)]
    )


def test_agreement_is_against_each_prompts_sequential_run_under_the_same_limit():
    runs = [
        _tokens_run("lever", "1GiB", 1, {0: [1, 2, 3, 4], 1: [5, 6, 7, 8]}),
        _tokens_run("lever", "1GiB", 2, {0: [1, 2, 3, 4], 1: [5, 6, 0, 8]}),
        _tokens_run("llama-server", "1GiB", 2, {0: [1, 2], 1: [5, 6, 7, 8]}),
        _tokens_run("lever", "3GiB", 1, {0: [9, 9, 9, 9]}),
        _tokens_run("lever", "3GiB", 2, {0: [9, 9, 9, 9]}),
    ]
    agreed = with_agreement(runs)
    share = {
        (run.engine, run.limit, run.parallel, r.prompt_index): r.agreement
        for run in agreed
        for round_ in run.rounds
        for r in round_.requests
    }
    assert share[("lever", "1GiB", 2, 0)] == 1.0
    assert share[("lever", "1GiB", 2, 1)] == 0.75
    assert share[("llama-server", "1GiB", 2, 0)] == 0.5  # two of the reference's four
    assert share[("lever", "3GiB", 2, 0)] == 1.0  # its own limit's run, not 1 GiB's
    # the lowest of ours beside another request, not llama-server's
    assert concurrency_summary(agreed).min_agreement == 0.75


def test_a_failed_run_has_no_figures():
    requests = [_request(0.0, 2.0)]
    ok = with_figures(ConcurrencyRun("lever", "1GiB", 1, rounds=[round_of(requests)]))
    assert ok.aggregate_tok_s == pytest.approx(4 / 2.0)
    assert ok.mean_first_token_s == pytest.approx(0.5)
    assert ok.mean_request_decode_tok_s == pytest.approx(3 / 1.5)
    failed = ConcurrencyRun("lever", "1GiB", 2, rounds=[round_of(requests)], failed="OOM")
    assert with_figures(failed).aggregate_tok_s is None


# --- prompts and options ----------------------------------------------------------------


def test_rounds_mix_the_prompt_sets_and_take_every_prompt_in_full_rounds():
    sets = [PromptSet("humaneval", [[1], [2], [3]]), PromptSet("sharegpt", [[4], [5]])]
    mixed = mixed_prompts(sets)
    assert [(p.prompt_set, p.index) for p in mixed] == [
        ("humaneval", 0), ("sharegpt", 0), ("humaneval", 1), ("sharegpt", 1), ("humaneval", 2),
    ]  # fmt: skip
    assert [[p.tokens[0] for p in r] for r in rounds_of(mixed, 1)] == [[1], [4], [2], [5], [3]]
    assert [[p.tokens[0] for p in r] for r in rounds_of(mixed, 2)] == [[1, 4], [2, 5], [3, 1]]
    assert [[p.tokens[0] for p in r] for r in rounds_of(mixed, 5)] == [[1, 4, 2, 5, 3]]
    with pytest.raises(ValueError):
        rounds_of(mixed, 6)


def test_parallel_options_from_the_command_line(bench_parser):
    options = options_from_args(bench_parser.parse_args(["--parallel", "1,2,4,8"]))
    assert options.parallel == (1, 2, 4, 8)
    assert options.limits == ("1GiB", "3GiB")
    assert options.prompt_sets == ("humaneval", "sharegpt")
    assert options.prompts == 4  # 8 different prompts for 8 at once
    assert options.modes == ("lever",) and options.isolate == "all"
    assert options.max_new_tokens == 128
    given = bench_parser.parse_args(
        ["--parallel", "1,2", "--limits", "3GiB", "--prompts", "1", "--max-new-tokens", "8"]
    )
    assert options_from_args(given).limits == ("3GiB",)
    plain = options_from_args(bench_parser.parse_args([]))
    assert (plain.parallel, plain.prompts, plain.prompt_sets) == ((), 5, ("humaneval",))
    for argv, error in (
        (["--parallel", "2,4"], "needs 1 among"),
        (["--parallel", "1,4", "--prompts", "1"], "needs as many different prompts"),
        (["--parallel", "1,2", "--sweep"], "runs of their own"),
        (["--parallel", "1,2", "--temperature", "0.7"], "greedily"),
    ):
        with pytest.raises(ConfigError, match=error):
            options_from_args(bench_parser.parse_args(argv))


def test_ours_is_lever_as_limits_plans_it_with_n_requests_at_once(tiny_pair):
    target, draft = tiny_pair
    options = BenchOptions(
        modes=("lever",), limits=("1GiB",), isolate="all", parallel=(1, 2), prompts=2
    )
    workload = Workload(target, draft, [], frozenset())
    planned = parallel_lever(options, workload, "1GiB", 4)
    config = planned.spec.config  # type: ignore[union-attr]
    assert config.parallel == 4
    assert config.dram_budget.kind == "auto" and config.plan == "auto"
    assert config.draft == str(draft)
    assert planned.info.name == "lever x4@1GiB"
    assert planned.info.memory_limit_bytes == 2**30 and planned.info.isolated


# --- llama-server -----------------------------------------------------------------------


def _spec(program: str, model: str, draft: str | None = None) -> LlamaCppSpec:
    return LlamaCppSpec(
        program=program, model=model, tokenizer="", prompt_dir="", draft=draft, draft_max=6
    )


def test_server_command_lines():
    plain = server_command(_spec("/l/llama-server", "/m/t.gguf"), 8123, 4, 512)
    assert plain == [
        "/l/llama-server", "-m", "/m/t.gguf", "--host", "127.0.0.1", "--port", "8123",
        "-np", "4", "-c", "2048", "-t", "2", "--cache-ram", "0",
    ]  # fmt: skip
    drafted = server_command(_spec("/l/llama-server", "/m/t.gguf", "/m/d.gguf"), 8123, 2, 768)
    assert drafted[drafted.index("-c") + 1] == "1536"  # two slots of 768
    assert drafted[-6:] == [
        "-md", "/m/d.gguf", "--spec-type", "draft-simple", "--spec-draft-n-max", "6",
    ]  # fmt: skip


@pytest.fixture
def fake_server():
    """A stand-in llama-server on a thread whose requests each wait for three."""
    server = FakeServer(together=3)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


async def test_the_driver_sends_requests_at_once_and_reads_their_streams(fake_server):
    prompts = [[1, 2], [3], [4, 5, 6]]
    answers = await complete_together(fake_server.port, prompts, 6)  # one after the other: 500
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer.tokens == [t for chunk in reply(prompt, 6) for t in chunk]
        assert answer.first_step_tokens == 2
        assert len(answer.stamps) == len(answer.tokens)
        assert answer.stamps == sorted(answer.stamps)
        assert answer.started < answer.stamps[0] <= answer.stamps[-1] < answer.ended
        assert answer.stop_type == "eos"
        assert answer.timings == {"prompt_n": len(prompt), "predicted_n": 5, "prompt_ms": 1.5}
    body = fake_server.bodies[0]
    assert body["temperature"] == 0 and body["n_predict"] == 6
    assert body["cache_prompt"] is False and body["stream"] and body["return_tokens"]
    assert sorted(b["prompt"] for b in fake_server.bodies) == sorted(prompts)


async def test_the_driver_fails_on_a_refusal(fake_server):
    with pytest.raises(ModeFailed, match="answered 400.*empty prompt"):
        await complete_together(fake_server.port, [[1], [], [2]], 4)


@pytest.fixture
def server_program(tmp_path) -> str:
    """An executable that runs the stand-in with llama-server's command line."""
    program = tmp_path / "llama-server"
    program.write_text(f'#!/bin/sh\nexec {sys.executable} {fake_llama_server.__file__} "$@"\n')
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    return str(program)


async def test_llama_server_runs_rounds_under_its_limit_and_is_stopped(server_program, tmp_path):
    model = tmp_path / "target.gguf"
    model.write_bytes(b"GGUF")
    prompts = [Prompt("humaneval", 0, [1, 2]), Prompt("sharegpt", 0, [3, 4, 5])]
    rounds = rounds_of(prompts, 2)
    spec = _spec(server_program, str(model))
    run = await run_server(spec, "llama-server", SUPPORT, "1GiB", 2, rounds, 5, EOS)
    assert run.failed is None, run.failed
    assert (run.engine, run.limit, run.parallel) == ("llama-server", "1GiB", 2)
    assert run.limit_enforced == SUPPORT.usable
    assert run.memory_limit_bytes == pytest.approx(2**30, abs=8192)
    assert run.peak_rss_bytes and run.peak_rss_bytes > 1 << 20  # the stand-in's own
    (requests,) = [r.requests for r in run.rounds]
    for prompt, request in zip(prompts, requests, strict=True):
        streamed = [t for chunk in reply(prompt.tokens, 5) for t in chunk]
        assert request.tokens == [*streamed, EOS]  # its end token counted, as ours count it
        assert request.reported is not None and request.reported["stop_type"] == "eos"
    assert run.command is not None and run.command.startswith(server_program)
    port = int(run.command.split("--port ")[1].split()[0])
    assert not healthy(port)  # stopped


async def test_a_llama_server_that_fails_fails_the_run_with_its_error(server_program, tmp_path):
    rounds = rounds_of(PROMPTS, 1)
    spec = _spec(server_program, "/no/such/model.gguf")
    run = await run_server(spec, "llama-server-draft", None, "3GiB", 1, rounds, 5, EOS)
    assert run.rounds == [] and run.aggregate_tok_s is None
    assert run.failed is not None
    assert "llama-server failed (exit status 1): llama_model_load: error loading" in run.failed
    # one that dies under the requests: why it died, not the broken connection
    model = tmp_path / "target.gguf"
    model.write_bytes(b"GGUF")
    spec = _spec(server_program, str(model))
    run = await run_server(spec, "llama-server", None, "3GiB", 1, rounds, DIE, EOS)
    assert run.failed == "llama-server failed (exit status 3): ggml: error: out of memory"
    unavailable = msgspec.structs.replace(spec, unavailable="llama.cpp is not built")
    run = await run_server(unavailable, "llama-server", None, "3GiB", 1, rounds, 5, EOS)
    assert run.failed == "unavailable: llama.cpp is not built"


# --- ours -------------------------------------------------------------------------------


SLEEP_S = 0.2  # a SleepyMode request's real time


class SleepyMode(FakeMode):
    """Takes SLEEP_S of real time a prompt, its tokens evenly over the second half."""

    async def decode(self, prompt, max_new_tokens, stop_ids, sampling):
        decoded = await super().decode(prompt, max_new_tokens, stop_ids, sampling)
        await trio.sleep(SLEEP_S)
        now, n = time.perf_counter(), len(decoded.tokens)
        decoded.stamps = [now - SLEEP_S / 2 * (1 - i / max(n - 1, 1)) for i in range(n)]
        return decoded


class TogetherMode:
    """A fake mode decoding prompts at once in this process, as a child does."""

    def __init__(self, mode: FakeMode, info: ModeInfo) -> None:
        self.mode = mode
        self.info = info

    async def open(self, stack: AsyncExitStack) -> None:
        await self.mode.open(stack)

    async def decode_together(
        self, prompts, max_new_tokens, stop_ids, sampling, delays=()
    ) -> Together:
        return await decode_together(self.mode, prompts, max_new_tokens, stop_ids, sampling, delays)


async def test_ours_decodes_each_round_at_once():
    info = ModeInfo("lever x2@1GiB", "lever", plan="trees", limit_enforced=True)
    mode = TogetherMode(SleepyMode(info, rate=1.0), info)
    options = BenchOptions(modes=("lever",), limits=("1GiB",), isolate="all", max_new_tokens=5)
    workload = Workload(Path("."), None, [], frozenset())
    run = await run_ours(mode, "1GiB", 2, rounds_of(PROMPTS, 2), options, workload)
    assert run.failed is None and run.plan == "trees" and run.limit_enforced
    (round_,) = run.rounds
    for prompt, request in zip(PROMPTS, round_.requests, strict=True):
        assert request.tokens == [(sum(prompt.tokens) + i) % 97 for i in range(5)]
        assert request.first_token_s == pytest.approx(SLEEP_S / 2, abs=0.05)
        assert request.decode_tok_s == pytest.approx(4 / (SLEEP_S / 2))
    # both started together: the round lasts about one request's time, not two
    assert SLEEP_S <= round_.wall_s < 1.75 * SLEEP_S
    # then the longer prompt joined the first while it decoded: once it had given its
    # tokens (fewer than JOIN_AFTER_TOKENS: its end), so that it came beside nobody
    joining = run.joining
    assert joining is not None and joining.running == 1
    longest = max(PROMPTS, key=lambda p: len(p.tokens))
    assert (joining.prompt_set, joining.prompt_index) == (longest.prompt_set, longest.index)
    assert joining.prompt_tokens == len(longest.tokens) - 2
    assert joining.first_token_alone_s == pytest.approx(SLEEP_S / 2, abs=0.05)
    assert joining.first_token_busy_s == pytest.approx(SLEEP_S / 2, abs=0.05)
    broken = TogetherMode(FakeMode(info, rate=10.0, fail_at=2), info)
    run = await run_ours(broken, "1GiB", 2, rounds_of(PROMPTS, 2), options, workload)
    assert run.failed == "NotImplementedError: Cannot copy out of meta tensor; no data!"


async def test_a_child_decodes_together_what_it_decodes_alone(one_set, tmp_path):
    options = BenchOptions(
        modes=("lever",),
        limits=("3GiB",),
        isolate="all",
        parallel=(1, 2),
        prompts=2,
        draft_dtype="float32",
        cache_dir=str(tmp_path),
    )
    prompts = one_set.prompt_sets[0].prompts
    mode = ChildMode(parallel_lever(options, one_set, "3GiB", 2), SUPPORT)
    async with AsyncExitStack() as stack:
        await mode.open(stack)
        together = await mode.decode_together(prompts, 6, frozenset(), GREEDY)
        alone = [await mode.decode(p, 6, frozenset(), GREEDY) for p in prompts]
    assert [d.tokens for d in together.decoded] == [d.tokens for d in alone]
    assert all(s <= e for s, e in zip(together.started, together.ended, strict=True))
    assert together.peak_rss_bytes and together.peak_rss_bytes > 50 * 2**20
    assert (together.cgroup_peak_bytes is not None) == SUPPORT.usable


# --- results ----------------------------------------------------------------------------


def test_results_to_json_markdown_and_plot(tmp_path, monkeypatch):
    def run(engine: str, limit: str, parallel: int, wall: float, failed=None) -> ConcurrencyRun:
        requests = [_request(0.0, wall, tokens=8) for _ in range(parallel)]
        return with_figures(
            ConcurrencyRun(engine, limit, parallel, rounds=[round_of(requests)], failed=failed)
        )

    runs = [
        run("lever", "1GiB", 1, 2.0),
        run("llama-server", "1GiB", 1, 8.0),
        run("llama-server-draft", "1GiB", 1, 6.0, failed="unavailable: not built"),
        msgspec.structs.replace(
            run("lever", "1GiB", 4, 4.0), joining=Joining("prose", 2, 400, 2.0, 3.0, 3, 0.1, 0.25)
        ),
        run("llama-server", "1GiB", 4, 16.0),
    ]
    results = ConcurrencyResults(
        machine=Machine.here(),
        command="lever-actors bench --parallel 1,4",
        config={},
        runs=runs,
        summary=concurrency_summary(runs),
    )
    out = tmp_path / "concurrency.json"
    drawn = {}
    monkeypatch.setattr(
        plots, "concurrency_plot", lambda r, p: drawn.update(plots.concurrency_data(r))
    )
    written = write_outputs(results, out)
    assert read_results(out) == results
    assert results.summary.aggregate_4_over_1_at_1gib == pytest.approx((32 / 4.0) / (8 / 2.0))
    assert results.summary.aggregate_4_vs_llamacpp_server_1gib == pytest.approx(4.0)
    markdown = output_paths(out)["markdown"].read_text()
    assert markdown == render_markdown(results)
    assert "| 1GiB | 4 | 8.00 | 2.00 | — | 4.00x |" in markdown
    assert "| 1GiB | 1 | 4.00 | 1.00 | unavailable | 4.00x |" in markdown
    assert "over 1, under 1 GiB: 2.00x" in markdown
    assert results.summary.ttft_joining_busy_over_alone == pytest.approx(1.5)
    assert results.summary.joining_gap_over_step == pytest.approx(2.5)
    assert "| 1GiB | 3 | 400 | 2.00 | 3.00 | 0.100 | 0.250 |" in markdown
    assert output_paths(out)["concurrency"] in written
    assert drawn["1GiB"]["lever"] == [(1, 4.0), (4, 8.0)]
    assert drawn["1GiB"]["llama-server-draft"] == []


def test_bench_with_parallel_runs_the_requests_at_once_and_writes_their_files(
    tmp_path, monkeypatch
):
    """One entry point: `bench` with --parallel runs bench/concurrency.py's runs in place
    of the modes, and writes their files as it does a modes run's."""
    options = BenchOptions(
        modes=("lever",), limits=("1GiB",), isolate="all", parallel=(1, 2), prompts=2
    )
    runs = [ConcurrencyRun("lever", "1GiB", 1, rounds=[Round([_request(0.0, 1.0)], 1.0)])]
    made = ConcurrencyResults(
        machine=Machine.here(),
        command="lever-actors bench --parallel 1,2",
        config=options.as_config(),
        runs=runs,
        summary=concurrency_summary(runs),
    )
    asked = []

    def parallel_runs(options, workload, cgroups, command, log):
        asked.append((options, command))
        return made

    monkeypatch.setattr(bench_run, "parallel_runs", parallel_runs)
    out = tmp_path / "concurrency.json"
    workload = Workload(tmp_path, None, [], frozenset())
    results = bench_run.bench(options, workload, out=out, command=made.command, plots=False)
    assert asked == [(options, made.command)]
    assert results == made  # no disk under a target that is not a layout
    assert read_results(out) == made
    assert output_paths(out)["markdown"].read_text() == render_markdown(made)


def test_the_plot_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    rounds = [Round([_request(0.0, 1.0)], 1.0)]
    runs = [ConcurrencyRun("lever", limit, 1, rounds=rounds) for limit in ("1GiB", "3GiB")]
    results = ConcurrencyResults(
        machine=Machine.here(),
        command="",
        config={},
        runs=[with_figures(r) for r in runs],
        summary=concurrency_summary(runs),
    )
    path = tmp_path / "c-concurrency.png"
    data = plots.concurrency_plot(results, path)
    assert list(data) == ["1GiB", "3GiB"]
    assert Image.open(path).size[0] > Image.open(path).size[1]  # two panels side by side
