"""`lever-actors --help` lists every command without importing any command's module (no
torch, no idle-core probe); a command's own --help still gives its every flag (#63)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lever_actors.cli import _parser
from lever_actors.cli.commands import COMMANDS, command_in

# `lever-actors ARGS` through the entry point's module (its main, which returns: console
# would end the process), then what it imported
RUN = (
    "import sys; args = sys.argv[1:]; sys.argv = ['lever-actors', *args]\n"
    "import lever_actors.launch as launch\n"
    "try:\n    launch.main(args)\nexcept SystemExit:\n    pass\n"
    "print('IMPORTED', *sorted(sys.modules))"
)


def launched(*args: str) -> tuple[str, set[str]]:
    done = subprocess.run(
        [sys.executable, "-c", RUN, *args], capture_output=True, text=True, check=True
    )
    shown, _, imported = done.stdout.rpartition("IMPORTED")
    return shown, set(imported.split())


@pytest.mark.parametrize("args", [["--help"], ["--version"]])
def test_help_and_version_import_no_command_and_no_torch(args):
    shown, imported = launched(*args)
    assert "torch" not in imported and "numpy" not in imported
    assert not {f"lever_actors.cli.{m}" for m, _ in COMMANDS.values()} & imported
    if args == ["--help"]:
        assert all(command in shown for command in COMMANDS)
        assert "stream text: the pipeline" in shown  # each command's line


def test_a_commands_help_gives_its_flags_from_its_module_alone():
    shown, imported = launched("report", "--help")
    assert "lever_actors.cli.report" in imported and "lever_actors.cli.generate" not in imported
    assert "a results JSON written by `bench`" in shown
    shown, _ = launched("generate", "--help")
    assert "--draft-vocabulary" in shown


def test_the_command_is_the_first_word_that_names_one_not_a_cache_dir():
    assert command_in(["-v", "generate", "--prompt", "serve"]) == "generate"
    assert command_in(["--cache-dir", "bench", "report", "r.json"]) == "report"
    assert command_in(["--help"]) is None


def test_the_whole_parser_and_the_lean_one_list_the_same_commands_in_order():
    lean = _parser(())._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    whole = _parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert list(lean) == list(whole) == list(COMMANDS)
