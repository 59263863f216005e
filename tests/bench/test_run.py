"""The harness end to end on a tiny pair: every mode (ours and the transformers peer) on two
prompt sets of two prompts, to JSON, markdown and PNGs whose contents are checked against
the raw per-prompt figures."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
from PIL import Image

from lever_actors.bench import plots
from lever_actors.bench.plan import BenchOptions
from lever_actors.bench.report import output_paths
from lever_actors.bench.results import BenchResults, read_results
from lever_actors.bench.run import bench
from lever_actors.model.sampling import Sampling

ALL_MODES = (
    "memory-ar",
    "flash-ar",
    "sd-chain",
    "sd-static",
    "lever",
    "peer-memory",
    "peer-offload",
    "peer-assisted",
)
EXPECTED_NAMES = [
    "memory-ar",
    "flash-ar@50%",
    "sd-chain:2@50%",
    "sd-static:2,1@50%",
    "lever@50%",
    "peer-memory",
    "peer-offload@50%",
    "peer-assisted@50%",
]


@pytest.fixture(scope="module")
def run(workload, tmp_path_factory):
    out = tmp_path_factory.mktemp("results") / "headline.json"
    options = BenchOptions(
        modes=ALL_MODES,
        budgets=("50%",),
        chain=(2,),
        static_tree="2,1",
        draft_dtype="float32",
        prompt_sets=("humaneval", "sharegpt"),
        prompts=2,
        max_new_tokens=8,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
    )
    results = bench(options, workload, out=out, command="test")
    return results, out


def _rate(results: BenchResults, mode: str, prompt_set: str) -> float:
    runs = [r for r in results.runs if r.mode == mode and r.prompt_set == prompt_set]
    assert len(runs) == 2
    return sum(r.new_tokens - r.first_step_tokens for r in runs) / sum(r.decode_s for r in runs)


def test_every_mode_ran_on_every_prompt(run):
    results, out = run
    assert [m.name for m in results.modes] == EXPECTED_NAMES
    assert results.reference_mode == "memory-ar"
    for name in EXPECTED_NAMES:
        for prompt_set in ("humaneval", "sharegpt"):
            runs = [r for r in results.runs if r.mode == name and r.prompt_set == prompt_set]
            assert [r.prompt_index for r in runs] == [0, 1]
            assert all(r.failed is None and r.new_tokens == 8 for r in runs), runs
            assert all(r.agreement is not None and r.peak_rss_bytes for r in runs)
            (summary,) = [
                s for s in results.summaries if s.mode == name and s.prompt_set == prompt_set
            ]
            assert summary.failed is None and summary.prompts == 2
            assert summary.decode_tok_s == pytest.approx(_rate(results, name, prompt_set))
    flash = [r for r in results.runs if r.mode == "flash-ar@50%"]
    assert all(r.bytes_read > 0 and r.steps == r.new_tokens for r in flash)
    info = results.info("lever@50%")
    assert info.family == "lever" and info.tree == "gaincost" and info.budget_bytes
    assert not info.isolated and not info.limit_enforced
    for name in ("peer-offload@50%", "peer-assisted@50%"):
        assert "accelerate placed" in results.info(name).note


def test_json_is_valid_and_finite(run):
    results, out = run
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert read_results(out) == results

    def walk(value):
        if isinstance(value, float):
            assert math.isfinite(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(json.loads(text))
    assert results.machine.disk_bandwidth and results.disk
    assert results.config["modes"] == list(ALL_MODES)


def test_ratios_come_from_the_raw_figures(run):
    results, _ = run
    s = results.summary
    assert s.budget == "50%"
    baselines = {
        "flash_ar": ["flash-ar@50%"],
        "best_sd": ["sd-chain:2@50%", "sd-static:2,1@50%"],
        "memory_ar": ["memory-ar"],
        "peer": ["peer-offload@50%", "peer-assisted@50%"],
    }
    for key, modes in baselines.items():
        per_set = []
        for prompt_set in ("humaneval", "sharegpt"):
            best = max(modes, key=lambda m, p=prompt_set: _rate(results, m, p))
            expected = _rate(results, "lever@50%", prompt_set) / _rate(results, best, prompt_set)
            got = getattr(s.per_prompt_set[prompt_set], f"lever_vs_{key}")
            assert got == pytest.approx(expected)
            assert s.compared[prompt_set][key] == best
            per_set.append(expected)
        assert getattr(s, f"lever_vs_{key}") == pytest.approx(sum(per_set) / 2)


def test_markdown_lists_every_mode_and_ratio(run):
    results, out = run
    text = output_paths(out)["markdown"].read_text()
    for name in EXPECTED_NAMES:
        assert text.count(f"| {name} |") == 2
    assert "failed" not in text and "nan" not in text.lower()
    for label in ("flash-AR", "best SD", "memory-resident AR", "transformers peer"):
        assert f"| {label} |" in text
    assert f"{results.summary.lever_vs_peer:.2f}x" in text
    assert "not per mode" in text  # peak RSS is the harness's own when not isolated


def test_pngs_show_the_results(run):
    results, out = run
    paths = output_paths(out)
    for key in ("throughput", "accepted"):
        with Image.open(paths[key]) as image:
            assert image.format == "PNG" and image.width > 300 and image.height > 200
            assert len(image.convert("RGB").getcolors(1 << 16) or []) > 10  # not blank
    normalised = plots.throughput_data(results)
    assert set(normalised) == set(EXPECTED_NAMES)
    for name in EXPECTED_NAMES:
        for prompt_set in ("humaneval", "sharegpt"):
            expected = _rate(results, name, prompt_set) / _rate(results, "lever@50%", prompt_set)
            assert normalised[name][prompt_set] == pytest.approx(expected)
    accepted = plots.accepted_data(results)
    assert set(accepted) == {
        "sd-chain:2@50%",
        "sd-static:2,1@50%",
        "lever@50%",
        "peer-assisted@50%",
    }
    for name, per_set in accepted.items():
        for prompt_set, value in per_set.items():
            runs = [r for r in results.runs if r.mode == name and r.prompt_set == prompt_set]
            steps = sum(r.steps for r in runs)
            assert value == pytest.approx(sum(r.new_tokens for r in runs) / steps)
            assert value >= 1.0


@pytest.mark.parametrize("isolate", ["none", "all"])
def test_a_sampled_run_agrees_token_for_token_and_peers_refuse_it(
    workload, tmp_path_factory, isolate
):
    """Every mode of ours samples with the bench's seed, so each agrees with memory-AR (the
    reference) on every token, in this process and in children (there, Lever alone: a child
    a mode, each importing torch); the peer cannot sample."""
    sampling = Sampling(temperature=0.9, top_p=0.9, seed=11)
    in_children = isolate == "all"
    ours_modes = (
        ("memory-ar", "lever") if in_children else ("memory-ar", "flash-ar", "sd-chain", "lever")
    )
    options = BenchOptions(
        modes=(*ours_modes, "peer-memory"),
        budgets=("50%",),
        chain=(2,),
        draft_dtype="float32",
        prompts=2,
        max_new_tokens=8,
        sampling=sampling,
        isolate=isolate,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
    )
    out = tmp_path_factory.mktemp("results") / "sampled.json"
    results = bench(options, workload, out=out, command="test")
    ours = [r for r in results.runs if not r.mode.startswith("peer")]
    assert len(ours) == len(ours_modes) * 4  # two prompt sets of two prompts
    assert all(r.failed is None and r.agreement == 1.0 for r in ours)
    peer = [r for r in results.runs if r.mode == "peer-memory"]
    assert peer and all(r.failed == "the transformers peer decodes greedily only" for r in peer)
    assert results.config["sampling"] == msgspec.structs.asdict(sampling)
