"""`lever-actors generate` on tiny models: what to continue (raw --prompt, --chat,
--messages with --system, '-' for stdin), sampling flags, --stats json, and the errors."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from lever_actors.cli import main
from lever_actors.model.sampling import Sampling
from lever_actors.testing import TINY_ARGS, model_pair, reference_tokens

NEW = 8


@pytest.fixture(scope="module")
def pair():
    return model_pair(TINY_ARGS, "perturbed", 0, tokenizer="words")


def run(capsys, pair, *flags: str, model: bool = False) -> tuple[int, str, str]:
    where = ["--model", str(pair.target)] if model else ["--target", str(pair.target)]
    where += [] if model else ["--draft", str(pair.draft), "--tree", "chain:3"]
    code = main(["generate", *where, "--max-new-tokens", str(NEW), *flags])
    out, err = capsys.readouterr()
    return code, out, err


def text_of(tokens: list[int]) -> str:
    """What the word-level tokenizer's text gains when `tokens` follow a prompt: each word
    after a space (the prompt's last word is decoded with them as context)."""
    return "".join(f" t{t}" for t in tokens)


def stats(err: str) -> dict:
    return json.loads(err.strip().splitlines()[-1])


@pytest.mark.parametrize("model", [False, True], ids=["pipeline", "in-memory"])
def test_raw_prompt_streams_the_reference_text_and_json_stats(capsys, pair, model):
    code, out, err = run(capsys, pair, "--prompt", "t3 t1 t4", "--stats", "json", model=model)
    assert code == 0
    assert out == text_of(reference_tokens(pair.target, [3, 1, 4], NEW)) + "\n"
    figures = stats(err)
    assert figures["prompt_tokens"] == 3
    assert figures["generated_tokens"] == NEW
    assert figures["finish_reason"] == "length"
    assert figures["peak_rss_bytes"] > 0
    assert figures["seed"] is None
    assert ("steps" in figures) == (not model)


@pytest.mark.parametrize("model", [False, True], ids=["pipeline", "in-memory"])
def test_sampling_flags_sample_as_the_oracle_and_report_the_seed(capsys, pair, model):
    flags = ["--temperature", "0.8", "--top-k", "5", "--seed", "5", "--stats", "json"]
    code, out, err = run(capsys, pair, "--prompt", "t3 t1 t4", *flags, model=model)
    sampling = Sampling(temperature=0.8, top_k=5, seed=5)
    assert out == text_of(reference_tokens(pair.target, [3, 1, 4], NEW, sampling=sampling)) + "\n"
    assert stats(err)["seed"] == 5


def test_a_drawn_seed_is_reported(capsys, pair):
    _, _, err = run(capsys, pair, "--prompt", "t3", "--temperature", "1", "--stats", "json")
    assert isinstance(stats(err)["seed"], int)


def test_prompt_dash_reads_stdin(capsys, pair, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("t3 t1 t4"))
    _, out, _ = run(capsys, pair, "--prompt", "-")
    assert out == text_of(reference_tokens(pair.target, [3, 1, 4], NEW)) + "\n"


def test_messages_and_system_without_a_template_are_joined(capsys, pair, tmp_path):
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps([{"role": "user", "content": "t4"}]))
    _, out, err = run(capsys, pair, "--messages", str(messages), "--system", "t3 t1")
    assert out == text_of(reference_tokens(pair.target, [3, 1, 4], NEW)) + "\n"
    assert "no chat template: the messages are joined as raw text" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompt", "t1", "--chat", "t2"], "--prompt is raw text: it does not combine"),
        (["--chat", "t1", "--messages", "m.json"], "give --chat or --messages, not both"),
        (["--messages", "missing.json"], "--messages missing.json: "),
        (["--top-p", "0"], r"top_p = 0.0: expected in \(0, 1\]"),
        (["--temperature", "-1"], "temperature = -1.0: expected >= 0"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(
    capsys, pair, flags, message, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    Path("m.json").write_text("[]")
    code, _, err = run(capsys, pair, *flags)
    assert code == 2
    assert err.startswith("lever-actors: error: ")
    assert re.search(message, err), err


@pytest.mark.parametrize("model", [False, True], ids=["pipeline", "in-memory"])
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompt", ""], "the prompt is empty"),
        (["--prompt", "t1", "--max-new-tokens", "1000"], r"exceeds the context of 256 tokens"),
    ],
)
def test_both_paths_check_requests_alike(capsys, pair, model, flags, message):
    code, _, err = run(capsys, pair, *flags, model=model)
    assert code == 2
    assert re.search(message, err), err
