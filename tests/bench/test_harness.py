"""A mode that fails is reported as failed, with its error, on every prompt it did not
decode; ratios against it are left out, never NaN. Summary ratios on known figures."""

from __future__ import annotations

import msgspec
import pytest

from lever_actors.bench.harness import run_bench
from lever_actors.bench.report import markdown_table, render_markdown
from lever_actors.bench.results import PromptRun, write_results
from lever_actors.bench.summary import compute_summary
from tests.bench.fakes import SETS, BurstMode, FakeMode, info


async def test_failed_modes_are_rows_with_their_error(tmp_path):
    modes = [
        FakeMode(info("flash-ar@25%", "flash-ar"), 10.0),
        FakeMode(info("lever@25%", "lever", tree="gaincost"), 30.0, accept=3),
        FakeMode(info("peer-offload@25%", "peer-offload"), 2.0),
        FakeMode(info("peer-assisted@25%", "peer-assisted", tree="assisted"), 4.0, fail_at=2),
        FakeMode(
            info("sd-chain:4@25%", "sd-chain", tree="chain:4"), 1.0, fail_open=OSError("disk gone")
        ),
    ]
    results = await run_bench(
        modes, SETS, max_new_tokens=5, stop_ids=frozenset(), config={}, order="interleaved"
    )
    assisted = [r for r in results.runs if r.mode == "peer-assisted@25%"]
    assert [r.failed is None for r in assisted] == [True, False, False, False]
    assert "Cannot copy out of meta tensor" in assisted[1].failed
    assert modes[3].calls == 2  # not tried again after its failure
    chain = [r for r in results.runs if r.mode == "sd-chain:4@25%"]
    assert len(chain) == 4 and all(r.failed == "OSError: disk gone" for r in chain)
    for s in results.summaries:
        if s.mode in ("peer-assisted@25%", "sd-chain:4@25%"):
            assert s.failed and s.decode_tok_s is None
    summary = results.summary
    assert summary.lever_vs_flash_ar == pytest.approx(3.0)
    assert summary.lever_vs_peer == pytest.approx(15.0)  # the peer that worked
    assert summary.compared["a"]["peer"] == "peer-offload@25%"
    assert summary.lever_vs_best_sd is None and summary.lever_vs_memory_ar is None
    table = markdown_table(results)
    assert "failed: NotImplementedError: Cannot copy out of meta tensor; no data!" in table
    assert "failed: OSError: disk gone" in table
    text = render_markdown(results)
    assert "best SD" not in text.split("| mode |")[0]  # no ratio row for an absent baseline
    write_results(results, tmp_path / "r.json")
    raw = (tmp_path / "r.json").read_text()
    assert "NaN" not in raw and '"lever_vs_best_sd"' not in raw
    mean_accepted = {s.mode: s.mean_accepted for s in results.summaries if s.prompt_set == "a"}
    assert mean_accepted["lever@25%"] == pytest.approx(5 / 2)
    assert mean_accepted["flash-ar@25%"] == pytest.approx(1.0)


async def test_sequential_order_gives_the_same_rows():
    modes = [
        FakeMode(info("flash-ar@25%", "flash-ar"), 10.0),
        FakeMode(info("lever@25%", "lever"), 20.0),
    ]
    results = await run_bench(
        modes, SETS, max_new_tokens=4, stop_ids=frozenset(), config={}, order="sequential"
    )
    assert [r.mode for r in results.runs[:4]] == ["flash-ar@25%"] * 4  # one mode at a time
    assert all(r.agreement == 1.0 for r in results.runs)
    assert results.summary.lever_vs_flash_ar == pytest.approx(2.0)


async def test_interleaved_modes_take_turns_within_a_limit_and_one_limit_at_a_time():
    """Sequential runs let a minute of machine drift land on one mode (a plan regret of 1.81
    that was 1.04 interleaved); every limit's children at once would hold all the limits."""
    limited = [
        FakeMode(msgspec.structs.replace(info(f"{m}@{lim}", m), limit=lim), 10.0)
        for lim in ("1GiB", "2GiB")
        for m in ("lever", "lever-lookup")
    ]
    opened = []
    for mode in limited:
        original = mode.open

        async def open_(stack, mode=mode, original=original):
            opened.append((mode.info.name, len([r for r in limited if r.calls])))
            await original(stack)

        mode.open = open_
    results = await run_bench(
        limited, SETS, max_new_tokens=4, stop_ids=frozenset(), config={}, order="interleaved"
    )
    first = [r.mode for r in results.runs[:4]]
    assert first == ["lever@1GiB", "lever-lookup@1GiB"] * 2  # turns on each prompt
    assert {r.mode for r in results.runs[:8]} == {"lever@1GiB", "lever-lookup@1GiB"}
    # the 2 GiB children open only once the 1 GiB ones have decoded every prompt
    assert [o for o in opened if "2GiB" in o[0]] == [("lever@2GiB", 2), ("lever-lookup@2GiB", 2)]


def _run(mode, prompt_set, index, tokens, seconds, failed=None):
    return PromptRun(
        mode=mode,
        prompt_set=prompt_set,
        prompt_index=index,
        prompt_tokens=3,
        new_tokens=tokens,
        first_token_s=0.1,
        decode_s=seconds,
        agreement=1.0,
        tokens=list(range(tokens)),
        failed=failed,
    )


def test_summary_ratios_on_known_figures():
    modes = [
        info("memory-ar", "memory-ar", budget=None),
        info("flash-ar@25%", "flash-ar"),
        info("flash-ar@50%", "flash-ar", budget="50%"),
        info("sd-chain:2@25%", "sd-chain"),
        info("sd-static:2,1@25%", "sd-static"),
        info("lever@25%", "lever"),
        info("lever@50%", "lever", budget="50%"),
    ]
    runs = [
        # set x: lever 2 prompts, 9+9 tokens in 1+2 s -> 6 tok/s
        _run("lever@25%", "x", 0, 10, 1.0),
        _run("lever@25%", "x", 1, 10, 2.0),
        _run("memory-ar", "x", 0, 13, 1.0),  # 12 tok/s... over both prompts:
        _run("memory-ar", "x", 1, 13, 1.0),  # 24 / 2 s = 12 tok/s
        _run("flash-ar@25%", "x", 0, 4, 1.0),
        _run("flash-ar@25%", "x", 1, 4, 2.0),  # 6 / 3 s = 2 tok/s
        _run("flash-ar@50%", "x", 0, 100, 1.0),  # another budget: never compared
        _run("flash-ar@50%", "x", 1, 100, 1.0),
        _run("sd-chain:2@25%", "x", 0, 5, 1.0),
        _run("sd-chain:2@25%", "x", 1, 5, 1.0),  # 4 tok/s
        _run("sd-static:2,1@25%", "x", 0, 4, 1.0),
        _run("sd-static:2,1@25%", "x", 1, 4, 2.0),  # 2 tok/s
        # set y: lever 3 tok/s; sd-static the best SD; memory-ar failed on one prompt
        _run("lever@25%", "y", 0, 4, 1.0),
        _run("memory-ar", "y", 0, 0, 0.0, failed="out of memory"),
        _run("flash-ar@25%", "y", 0, 2, 1.0),
        _run("sd-chain:2@25%", "y", 0, 2, 1.0),
        _run("sd-static:2,1@25%", "y", 0, 3, 1.0),
    ]
    s = compute_summary(modes, runs)
    assert s.budget == "25%"
    x, y = s.per_prompt_set["x"], s.per_prompt_set["y"]
    assert x.lever_vs_memory_ar == pytest.approx(0.5)
    assert x.lever_vs_flash_ar == pytest.approx(3.0)
    assert x.lever_vs_best_sd == pytest.approx(1.5)
    assert s.compared["x"]["best_sd"] == "sd-chain:2@25%"
    assert y.lever_vs_best_sd == pytest.approx(1.5)
    assert s.compared["y"]["best_sd"] == "sd-static:2,1@25%"
    assert y.lever_vs_memory_ar is None  # failed there: left out
    assert s.lever_vs_flash_ar == pytest.approx((3.0 + 3.0) / 2)
    assert s.lever_vs_memory_ar == pytest.approx(0.5)  # the mean of the sets that have it
    assert s.lever_vs_peer is None
    at_50 = compute_summary(modes, runs, "50%")
    assert "x" not in at_50.per_prompt_set  # no lever@50% runs
    assert at_50.lever_vs_flash_ar is None


async def test_decode_rate_leaves_out_the_first_step():
    modes = [
        FakeMode(info("flash-ar@25%", "flash-ar"), 10.0),
        BurstMode(info("lever@25%", "lever", tree="gaincost"), 20.0, burst=4),
        BurstMode(info("sd-chain:4@25%", "sd-chain", tree="chain:4"), 20.0, burst=6),
    ]
    results = await run_bench(modes, SETS, max_new_tokens=6, stop_ids=frozenset(), config={})
    lever = [r for r in results.runs if r.mode == "lever@25%"]
    assert all(r.first_step_tokens == 4 and r.decode_tokens == 2 for r in lever)
    assert all(r.decode_tok_s == pytest.approx(20.0) for r in lever)
    assert results.summary.lever_vs_flash_ar == pytest.approx(2.0)
    # everything in the first step: no decode phase, so no rate (and no ratio), not infinity
    chain = [s for s in results.summaries if s.mode == "sd-chain:4@25%"]
    assert all(s.decode_tok_s is None and s.failed is None for s in chain)
    assert results.summary.lever_vs_best_sd is None
