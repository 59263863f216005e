"""`generate --plan ar` and `lookup` without torch (cli/generate_plain.py): on a tiny
quantized layout it streams the tokens the engine's `ar` streams, in a process that never
imports torch; where the plain path cannot run a request, the engine does, and says why
under -v."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import msgspec
import pytest
import torch

from lever_actors.checkpoints.layout_cache import layout_path
from lever_actors.cli import engine_config, generate_plain, main
from lever_actors.model import plain
from lever_actors.plain_target import embed_bytes
from lever_actors.plan import plain as plain_module
from lever_actors.testing import model_pair, reference_tokens
from lever_actors.testing.checkpoints import bf16_args
from tests.cli.test_generate import stats, text_of

NEW = 8
PROMPT = [3, 1, 4, 1, 5]

needs_plain = pytest.mark.skipif(
    not plain.available(), reason="this CPU cannot run the plain kernels"
)


@pytest.fixture(scope="module")
def layout():
    pair = model_pair(
        bf16_args(), "identical", tokenizer="words", dtype=torch.bfloat16, weights="q4k"
    )
    return pair.target


def run(capsys, layout, *flags: str) -> tuple[str, str]:
    prompt = " ".join(f"t{t}" for t in PROMPT)
    code = main(
        ["-v", "generate", "--target", str(layout), "--plan", "ar", "--prompt", prompt]
        + ["--max-new-tokens", str(NEW), "--stats", "json", *flags]
    )
    assert code == 0
    out, err = capsys.readouterr()
    return out, err


@needs_plain
@pytest.mark.parametrize("sampling", [[], ["--temperature", "1.5", "--seed", "3"]])
def test_the_plain_path_streams_the_engines_tokens(capsys, layout, monkeypatch, sampling):
    out, err = run(capsys, layout, *sampling)
    assert "plan: ar on the plain kernels, without torch" in err
    greedy = text_of(reference_tokens(layout, PROMPT, NEW)) + "\n"
    assert (out == greedy) == (not sampling)
    figures = stats(err)
    assert figures["generated_tokens"] == NEW and figures["tokens_per_step"] == 1.0
    assert figures["bytes_read_per_token"] == 0  # the whole layout in DRAM
    monkeypatch.setattr(generate_plain, "_run_and_why", lambda *a: (None, "asked for"))
    on_engine, err = run(capsys, layout, *sampling)
    assert "generate runs on the engine: asked for" in err
    assert on_engine == out


@needs_plain
@pytest.mark.parametrize("sampling", [[], ["--temperature", "1.5", "--seed", "3"]])
def test_lookup_on_the_plain_path_streams_the_tokens_of_one_a_pass(capsys, layout, sampling):
    one, _ = run(capsys, layout, *sampling)
    copied, err = run(capsys, layout, "--plan", "lookup", *sampling)
    assert "plan: lookup on the plain kernels, without torch" in err
    assert copied == one
    figures = stats(err)
    assert figures["steps"] * figures["tokens_per_step"] == pytest.approx(NEW)


@needs_plain
def test_the_plain_path_imports_no_torch(layout):
    code = (
        "import sys; from lever_actors.cli import main; "
        f"main(['generate', '--target', {str(layout)!r}, '--plan', 'ar', '--prompt', 't3 t1', "
        "'--max-new-tokens', '3']); print('torch' in sys.modules, file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "plan: ar on the plain kernels" in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--throttle", "ufs4.0"], "throttle asks for the engine"),
        (["--dram-budget", "all"], "dram_budget asks for the engine"),
    ],
)
def test_what_the_plain_path_cannot_run_goes_to_the_engine_saying_why(capsys, layout, flags, why):
    out, err = run(capsys, layout, *flags)
    assert f"generate runs on the engine: {why}" in err
    assert "plan: ar on the plain kernels" not in err and out.endswith("\n")


def test_a_layout_of_dense_matrices_goes_to_the_engine(capsys):
    dense = model_pair(bf16_args(), "identical", tokenizer="words", dtype=torch.bfloat16)
    _, err = run(capsys, dense.target)
    assert "is a dense matrix: the plain path multiplies quantized ones" in err
    assert json.loads(err.strip().splitlines()[-1])["generated_tokens"] == NEW


@needs_plain
def test_where_the_table_does_not_fit_its_rows_come_from_flash_and_the_tokens_stay(
    capsys, layout, monkeypatch
):
    resident, _ = run(capsys, layout)
    plan = plain_module.memory_plan

    def tight(config, manifest, *args, **kwargs):  # the layers and head fit, the table not
        memory = plan(config, manifest, *args, **kwargs)
        budget = manifest.file_bytes - embed_bytes(manifest)
        return msgspec.structs.replace(memory, budget=budget)

    monkeypatch.setattr(plain_module, "memory_plan", tight)
    streamed, err = run(capsys, layout)
    assert "the embedding's rows read from flash" in err
    assert streamed == resident
    assert stats(err)["bytes_read_per_token"] > 0
    monkeypatch.setattr(  # less than the layers and head: the engine's
        plain_module,
        "memory_plan",
        lambda *a, **k: msgspec.structs.replace(plan(*a, **k), budget=0),
    )
    _, err = run(capsys, layout)
    assert "the layers and the LM head would stream" in err


def _order(monkeypatch) -> list[str]:
    """What begins first as generate runs: the target's load or the tokenizer's parse."""
    seen: list[str] = []
    load, parse = generate_plain.TargetLoad.__init__, generate_plain.layout_tokenizer

    def loading(self, *args, **kwargs):
        seen.append("load")
        load(self, *args, **kwargs)

    def parsing(*args):
        seen.append("parse")
        return parse(*args)

    monkeypatch.setattr(generate_plain.TargetLoad, "__init__", loading)
    monkeypatch.setattr(generate_plain, "layout_tokenizer", parsing)
    return seen


@needs_plain
def test_the_target_reads_beside_the_tokenizers_parse_where_the_limit_holds_both(
    capsys, layout, monkeypatch
):
    seen = _order(monkeypatch)
    beside, _ = run(capsys, layout)
    assert seen == ["load", "parse"]
    seen.clear()
    monkeypatch.setattr(plain_module, "PARSE_PEAK_PER_FILE_BYTE", 1 << 40)  # no room for it
    after, err = run(capsys, layout)
    assert seen == ["parse", "load"]
    assert "plan: ar on the plain kernels" in err and after == beside


@needs_plain
def test_a_target_read_beside_the_parse_is_let_go_where_the_engine_runs_after_all(
    capsys, layout, monkeypatch
):
    plans = iter([True, False])  # room beside the parse, then none once the tokenizer is in
    plan = plain_module.memory_plan
    budget = {True: 1 << 40, False: 0}
    monkeypatch.setattr(
        plain_module,
        "memory_plan",
        lambda *a, **k: msgspec.structs.replace(plan(*a, **k), budget=budget[next(plans, False)]),
    )
    closed = []
    close = generate_plain.PlainTarget.close
    monkeypatch.setattr(
        generate_plain.PlainTarget, "close", lambda self: closed.append(1) or close(self)
    )
    out, err = run(capsys, layout)
    assert "the layers and the LM head would stream" in err and closed == [1]
    assert out == text_of(reference_tokens(layout, PROMPT, NEW)) + "\n"


@needs_plain
def test_a_first_run_converts_its_gguf_first_and_takes_the_plain_path(
    capsys, layout, tmp_path, monkeypatch
):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF stands in for the file; the conversion below copies the layout")
    conversions = []

    def converted(args):  # what engine_config does to a GGUF target on first use
        conversions.append(args.target)
        shutil.copytree(layout, layout_path(model, args.cache_dir, args.target_weights))

    monkeypatch.setattr(engine_config, "engine_config", converted)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for _ in range(2):
        out, err = run(capsys, model)
        assert "plan: ar on the plain kernels, without torch" in err
        assert out == text_of(reference_tokens(layout, PROMPT, NEW)) + "\n"
    assert conversions == [model]
