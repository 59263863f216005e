"""The results file is validated on read; `lever-actors report` rewrites only the README's
marked Results section, from the JSON."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import msgspec
import pytest
import trio

from lever_actors.bench.harness import run_bench
from lever_actors.bench.report import END_MARKER, START_MARKER, ReportError, rewrite_readme
from lever_actors.bench.results import ResultsError, read_results, write_results
from lever_actors.cli import main
from lever_actors.cli.bench import apply_config, options_from_args
from lever_actors.config import DramBudget
from lever_actors.errors import ConfigError
from tests.bench.fakes import SETS, FakeMode, info


@pytest.fixture
def results_file(tmp_path) -> Path:
    modes = [
        FakeMode(info("flash-ar@25%", "flash-ar"), 10.0),
        FakeMode(info("lever@25%", "lever", tree="gaincost"), 25.0, accept=2),
        FakeMode(info("peer-assisted@25%", "peer-assisted", tree="assisted"), 1.0, fail_at=1),
    ]
    results = trio.run(
        functools.partial(
            run_bench,
            modes,
            SETS,
            max_new_tokens=6,
            stop_ids=frozenset(),
            config={"modes": ["flash-ar", "lever"]},
            command="lever-actors bench --modes flash-ar,lever --budgets 25%",
        )
    )
    path = tmp_path / "benchmarks" / "results" / "headline.json"
    write_results(results, path)
    return path


README = """# project

Intro text, kept as is.

## Results

{start}
old numbers typed by hand
{end}

## After

More text | with a pipe.
"""


def test_report_rewrites_only_the_marked_section(results_file, tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(README.format(start=START_MARKER, end=END_MARKER))
    assert main(["report", str(results_file), "--readme", str(readme)]) == 0
    text = readme.read_text()
    head, rest = text.split(START_MARKER)
    section, tail = rest.split(END_MARKER)
    original_head, original_rest = README.format(start=START_MARKER, end=END_MARKER).split(
        START_MARKER
    )
    assert head == original_head and tail == original_rest.split(END_MARKER)[1]
    assert "old numbers" not in section
    assert "lever-actors bench --modes flash-ar,lever --budgets 25%" in section
    assert "| flash-AR | 2.50x |" in section
    # short: every mode and prompt set in the full report beside the JSON, linked
    assert "| lever@25% | a |" not in section
    assert "[benchmarks/results/headline.md](benchmarks/results/headline.md)" in section
    full = (results_file.parent / "headline.md").read_text()
    assert "| lever@25% | a |" in full and "| flash-ar@25% | b |" in full
    assert "failed: NotImplementedError: Cannot copy out of meta tensor" in full
    results = read_results(results_file)
    assert results.machine.date in section and results.machine.cpu in section
    assert (
        "![decode throughput normalised to Lever](benchmarks/results/headline-throughput.png)"
        in section
    )
    assert "(benchmarks/results/headline.json)" in section
    assert (results_file.parent / "headline-accepted.png").is_file()
    assert (results_file.parent / "headline.md").is_file()
    # idempotent: a second run changes nothing
    assert main(["report", str(results_file), "--readme", str(readme), "--no-plots"]) == 0
    assert readme.read_text() == text


@pytest.mark.parametrize(
    "text, message",
    [
        ("# no markers\n", "needs exactly one"),
        (f"{START_MARKER}\n{START_MARKER}\n{END_MARKER}\n", "needs exactly one"),
        (f"{END_MARKER}\nx\n{START_MARKER}\n", "comes before"),
    ],
)
def test_bad_markers_are_refused_and_nothing_changes(results_file, tmp_path, text, message):
    readme = tmp_path / "README.md"
    readme.write_text(text)
    with pytest.raises(ReportError, match=message):
        rewrite_readme(readme, "new")
    assert readme.read_text() == text
    assert main(["report", str(results_file), "--readme", str(readme), "--no-plots"]) == 1


def test_corrupted_results_give_a_clear_error(results_file, tmp_path):
    raw = results_file.read_bytes()
    cases = {
        "truncated.json": (raw[: len(raw) // 2], "not a results file"),
        "garbage.json": (b"\x00\x01 not json", "not a results file"),
        "old.json": (json.dumps({"schema": 1}).encode(), "schema 1"),
    }
    data = json.loads(raw)
    data["runs"][0]["new_tokens"] = "many"
    cases["wrong-type.json"] = (json.dumps(data).encode(), r"Expected `int`, got `str`.*runs\[0\]")
    data = json.loads(raw)
    del data["summary"]
    cases["missing.json"] = (json.dumps(data).encode(), "missing required field `summary`")
    data = json.loads(raw)
    data["summaries"][0]["decode_tok_s"] = None  # a None is fine where the schema allows it
    read_ok = tmp_path / "ok.json"
    read_ok.write_text(json.dumps(data))
    assert read_results(read_ok).summaries[0].decode_tok_s is None
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ResultsError, match=message) as caught:
            read_results(path)
        assert str(path) in str(caught.value)
    with pytest.raises(ResultsError, match="cannot read"):
        read_results(tmp_path / "absent.json")


def test_nan_is_never_written(results_file, tmp_path):
    results = read_results(results_file)
    broken = msgspec.structs.replace(
        results,
        summaries=[msgspec.structs.replace(results.summaries[0], decode_tok_s=float("nan"))],
    )
    with pytest.raises(ValueError, match="finite"):
        write_results(broken, tmp_path / "nan.json")
    assert not (tmp_path / "nan.json").exists()


def test_bench_options_from_the_command_line(bench_parser):
    args = bench_parser.parse_args(
        "--modes lever,peer-offload --budgets 25%,50% --chain 2,4 --isolate "
        "--order sequential --memory-limit 3GiB".split()
    )
    options = options_from_args(args)
    assert options.modes == ("lever", "peer-offload") and options.chain == (2, 4)
    assert options.isolate == "all" and options.order == "sequential"
    assert options.memory_limit == "3GiB"
    assert options_from_args(bench_parser.parse_args(["--isolate"])).order == "sequential"
    peers = options_from_args(bench_parser.parse_args(["--isolate", "peers"]))
    assert peers.isolate == "peers" and peers.order == "interleaved"
    assert peers.isolates("peer-offload") and not peers.isolates("lever")
    assert options_from_args(bench_parser.parse_args([])).order == "interleaved"
    sweep = options_from_args(bench_parser.parse_args(["--sweep"]))
    assert sweep.modes == ("flash-ar", "sd-chain", "sd-static", "lever")
    with pytest.raises(Exception, match="unknown bench mode"):
        options_from_args(bench_parser.parse_args(["--modes", "warp-drive"]))


def test_a_config_file_sets_defaults_that_flags_override(bench_parser, tmp_path):
    config = tmp_path / "headline.toml"
    config.write_text(
        'modes = ["memory-ar", "lever"]\nmax-new-tokens = 128\nprompts = 20\n'
        'prompt_sets = ["humaneval", "sharegpt"]\nisolate = "peers"\n'
    )
    apply_config(bench_parser, config)
    options = options_from_args(bench_parser.parse_args(["--prompts", "3"]))
    assert options.modes == ("memory-ar", "lever")
    assert options.prompt_sets == ("humaneval", "sharegpt")
    assert options.max_new_tokens == 128 and options.isolate == "peers"
    assert options.prompts == 3  # the flag wins


@pytest.mark.parametrize(
    "text, message",
    [
        ("warp = 9\n", "unknown option 'warp'"),
        ('isolate = "some"\n', "isolate must be one of none, peers, all"),
        ("modes = [\n", "not valid TOML"),
    ],
)
def test_a_bad_config_file_is_refused_with_the_reason(bench_parser, tmp_path, text, message):
    config = tmp_path / "bad.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=message):
        apply_config(bench_parser, config)
    with pytest.raises(ConfigError, match="cannot read bench config"):
        apply_config(bench_parser, tmp_path / "missing.toml")


def test_the_committed_headline_config_is_a_valid_bench_config(bench_parser):
    apply_config(bench_parser, Path(__file__).parents[2] / "benchmarks" / "headline.toml")
    options = options_from_args(bench_parser.parse_args([]))
    assert "lever" in options.modes and "peer-offload" in options.modes
    assert options.prompt_sets == ("humaneval", "sharegpt") and options.budgets == (
        DramBudget.parse("25%"),
    )
    assert options.prompts == 20 and options.max_new_tokens == 128
