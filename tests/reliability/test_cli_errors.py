"""The CLI's top level: every expected failure is one line and an exit code (2 usage, 1
runtime, 130 interrupt); a traceback only under -v or for a real bug. Requests are checked
before any model loads."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
from pathlib import Path

import pytest

from lever_actors.cli import main
from lever_actors.testing import TINY_ARGS, tiny_checkpoint

PREFIX = "lever-actors: error: "


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_checkpoint(TINY_ARGS, tokenizer="words")


def one_line(capsys) -> str:
    """stderr, checked to be the single line of an expected failure."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("\n") == 1, err
    return err


def read_only(monkeypatch, directory: Path) -> None:
    """Make `directory` a read-only file system's: creating anything in it fails with EROFS,
    as it does for root too (who ignores a directory's mode bits)."""
    real_mkdir = os.mkdir

    def mkdir(path, mode=0o777, *, dir_fd=None):
        if Path(path).parent == directory and not Path(path).exists():
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_mkdir(path, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", mkdir)


def unreadable(monkeypatch, path: Path) -> None:
    """Take away read permission from `path`; as root, whom mode bits do not stop, opening it
    fails as it would for anyone else."""
    path.chmod(0)
    if os.geteuid() != 0:
        return
    real_open = os.open

    def open_(file, flags, *args, **kwargs):
        if Path(file) == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), file)
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


def test_invalid_utf8_in_prompt_is_a_usage_error(capsys, model):
    prompt = b"t1 \xff t2".decode("utf-8", "surrogateescape")  # how Python hands over argv
    assert main(["generate", "--model", str(model), "--prompt", prompt]) == 2
    assert one_line(capsys) == f"{PREFIX}--prompt: not valid UTF-8 text (at position 3)\n"


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        ("inf%", "dram_budget must be positive and finite, got 'inf%'"),
        ("nan%", "dram_budget must be positive and finite, got 'nan%'"),
        ("9" * 400, "is too large a size"),
    ],
)
def test_an_infinite_dram_budget_is_a_usage_error(capsys, budget, message):
    flags = ["--target", "layout", "--dram-budget", budget, "--prompt", "t1"]
    assert main(["generate", *flags]) == 2  # before the layout, which does not exist, opens
    assert message in one_line(capsys)


def test_a_read_only_output_directory_is_a_runtime_error(capsys, model, tmp_path, monkeypatch):
    read_only(monkeypatch, tmp_path)
    assert main(["convert", str(model), str(tmp_path / "layout")]) == 1
    err = one_line(capsys)
    assert err.startswith(f"{PREFIX}{tmp_path}/.layout.partial-{os.getpid()}: ")
    assert err.endswith("Read-only file system\n")


def test_a_file_without_read_permission_is_a_runtime_error(capsys, tmp_path, monkeypatch):
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(1 << 16))
    unreadable(monkeypatch, data)
    assert main(["profile-disk", str(data), "--block-size", "4KiB"]) == 1
    assert one_line(capsys) == f"{PREFIX}{data}: Permission denied\n"


def test_a_missing_profile_disk_path_is_one_line(capsys, tmp_path):
    missing = tmp_path / "missing"
    assert main(["profile-disk", str(missing)]) == 2
    assert one_line(capsys) == f"{PREFIX}{missing}: no such file\n"


def test_a_broken_chat_template_is_a_runtime_error_naming_it(capsys, model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content }"
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["generate", "--model", str(broken), "--chat", "t1"]) == 1
    assert one_line(capsys) == f"{PREFIX}{broken}: broken chat template (line 1): unexpected '}}'\n"


def test_verbose_adds_the_traceback(capsys, model, tmp_path, monkeypatch):
    read_only(monkeypatch, tmp_path)
    assert main(["-v", "convert", str(model), str(tmp_path / "layout")]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.splitlines()[-1].endswith("Read-only file system")


def test_an_interrupt_exits_130(capsys, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("lever_actors.cli.tools.profile_disk", interrupted)
    assert main(["profile-disk", str(tmp_path / "data.bin")]) == 130
    assert capsys.readouterr().err == "lever-actors: interrupted\n"


def test_an_interrupt_inside_trios_exception_groups_exits_130(capsys, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise BaseExceptionGroup("from a nursery", [BaseExceptionGroup("", [KeyboardInterrupt()])])

    monkeypatch.setattr("lever_actors.cli.tools.profile_disk", interrupted)
    assert main(["profile-disk", str(tmp_path / "data.bin")]) == 130
    assert capsys.readouterr().err == "lever-actors: interrupted\n"


def test_a_real_bug_keeps_its_traceback(tmp_path, monkeypatch):
    def bug(*args, **kwargs):
        raise AttributeError("a bug")

    monkeypatch.setattr("lever_actors.cli.tools.profile_disk", bug)
    with pytest.raises(AttributeError, match="a bug"):
        main(["profile-disk", str(tmp_path / "data.bin")])


def test_a_bad_flag_is_argparses_usage_error(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["generate", "--max-new-tokens", "many"])
    assert exit.value.code == 2
    assert "invalid int value: 'many'" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["pipeline", "in-memory"])
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompt", ""], "the prompt is empty"),
        (["--max-new-tokens", "0"], "max_new_tokens must be positive, got 0"),
        (["--temperature", "nan"], "temperature = nan: expected >= 0"),
        (["--temperature", "1e-300"], "temperature = 1e-300: expected 0 (greedy) or at least"),
        (["--messages", "m.json"], "--messages m.json: messages[0].role = 'robot'"),
    ],
)
def test_requests_are_checked_before_any_model_loads(
    capsys, tmp_path, monkeypatch, path, flags, message
):
    def load(*args, **kwargs):
        raise AssertionError("a model loaded before the request was checked")

    monkeypatch.setattr("lever_actors.cli.generate_engine.load_checkpoint", load)
    monkeypatch.setattr("lever_actors.cli.generate_engine.Engine.open", load)
    monkeypatch.chdir(tmp_path)
    Path("m.json").write_text(json.dumps([{"role": "robot", "content": "t1"}]))
    where = ["--model", "m"] if path == "in-memory" else ["--target", "t", "--draft", "d"]
    assert main(["generate", *where, *flags]) == 2
    assert message in one_line(capsys)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tree", "chain:0"], "at least 1"),
        (["--dram-budget=-5%"], "dram_budget"),
    ],
)
def test_engine_flags_are_checked_before_the_real_pair_is_fetched(
    capsys, tmp_path, monkeypatch, flags, message
):
    def fetch(*args, **kwargs):
        raise AssertionError("the real pair was fetched before the flags were checked")

    monkeypatch.setattr("lever_actors.checkpoints.real_pair.real_target_layout", fetch)
    monkeypatch.setattr("lever_actors.checkpoints.real_pair.real_model_path", fetch)
    assert main(["--cache-dir", str(tmp_path), "generate", *flags]) == 2
    assert message in one_line(capsys)


@pytest.fixture
def taken_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@pytest.mark.parametrize(
    ("flags", "code", "message"),
    [
        (["--port", "99999"], 2, "port 99999: expected 0 to 65535"),
        (["--port", "-1"], 2, "port -1: expected 0 to 65535"),
        (["--host", "a..b"], 2, "host 'a..b': not a host name"),
        (["--host", "no-such-host.invalid"], 1, "no-such-host.invalid:8000: "),
        (["--host", "192.0.2.1"], 1, "192.0.2.1:8000: Cannot assign requested address"),
        (["--port", "TAKEN"], 1, "127.0.0.1:TAKEN: Address already in use"),
    ],
)
def test_an_address_serve_cannot_listen_on_is_one_line_before_anything_loads(
    capsys, tmp_path, monkeypatch, taken_port, flags, code, message
):
    def fetch(*args, **kwargs):
        raise AssertionError("the real pair was fetched before the address was checked")

    monkeypatch.setattr("lever_actors.checkpoints.real_pair.real_target_layout", fetch)
    flags = [flag.replace("TAKEN", str(taken_port)) for flag in flags]
    assert main(["--cache-dir", str(tmp_path), "serve", *flags]) == code
    assert one_line(capsys).startswith(PREFIX + message.replace("TAKEN", str(taken_port)))


def test_a_failure_inside_serves_trio_run_is_one_line(capsys, tmp_path):
    missing = tmp_path / "missing"  # the engine fails to open, inside trio's exception groups
    assert main(["serve", "--target", str(missing), "--port", "0"]) == 1
    assert one_line(capsys) == (
        f"{PREFIX}{missing}: not a flash layout (no manifest.json) nor a GGUF file; "
        "`lever-actors convert` makes a layout of a checkpoint\n"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--queue", "-1"], "argument --queue: expected 0 or more, got -1"),
        (["--max-tokens", "0"], "argument --max-tokens: expected 1 or more, got 0"),
        (["--grace", "-1"], "argument --grace: expected 0 or more seconds, got -1"),
        (["--grace", "nan"], "argument --grace: expected 0 or more seconds, got nan"),
    ],
)
def test_serves_negative_counts_are_refused_as_the_flags_are_parsed(capsys, flags, message):
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--target", "layout", *flags])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err
