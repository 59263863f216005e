"""The README shows what the code does: its command list is what the parser renders now
(lever_actors/cli/readme.py), and its library example runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lever_actors.cli import _parser
from lever_actors.cli.readme import (
    END_MARKER,
    START_MARKER,
    _options,
    _subcommands,
    block_of,
    main,
    render,
    rewrite,
)
from lever_actors.config import EngineConfig
from lever_actors.testing import TINY_ARGS, model_pair

README = Path(__file__).parents[2] / "README.md"
REGENERATE = "python -m lever_actors.cli.readme README.md"


def test_the_readmes_command_list_is_what_the_parser_renders_now():
    assert block_of(README.read_text()) == render().strip(), (
        f"a flag changed and the README's command list did not: run `{REGENERATE}`"
    )


def test_every_command_and_flag_is_listed_and_none_is_required():
    """The footer says every flag is optional; the list names each command and flag."""
    parser = _parser()
    text = render(parser)
    for name, command in _subcommands(parser):
        assert f"lever-actors {name}" in text
        for action in _options(command):
            assert not action.required, (name, action.option_strings)
            assert max(action.option_strings, key=len) in text, (name, action.option_strings)
    assert "--target-weights dense|auto|q4|q4k|q6|q8" in text
    assert all(len(line) <= 96 for line in text.splitlines() if not line.startswith("<!--"))


def test_rewrite_changes_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# head\n\n{START_MARKER}\nold\n{END_MARKER}\n\ntail\n")
    assert main([str(readme), "--check"]) == 1
    assert main([str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith(f"# head\n\n{START_MARKER}\n") and text.endswith(
        f"{END_MARKER}\n\ntail\n"
    )
    assert block_of(text) == render().strip()
    assert main([str(readme), "--check"]) == 0
    assert not rewrite(readme)  # already current: nothing written


@pytest.mark.parametrize(
    "text",
    [
        "no markers",
        f"{END_MARKER}\n{START_MARKER}",
        f"{START_MARKER}\n{START_MARKER}\n{END_MARKER}",
    ],
)
def test_a_readme_without_well_formed_markers_is_left_alone(tmp_path, text):
    readme = tmp_path / "README.md"
    readme.write_text(text)
    assert main([str(readme)]) == 1
    assert readme.read_text() == text


def test_the_readmes_library_example_runs(capsys):
    """The first Python block that opens an Engine runs as written, on a tiny pair in place
    of the real one: its `real_pair(...)` made the EngineConfig of the tiny pair, with the
    same fields."""
    blocks = README.read_text().split("```python\n")[1:]
    source = next(b.split("```")[0] for b in blocks if "Engine.open" in b)
    tree = ast.parse(source)
    pair = model_pair(TINY_ARGS, "perturbed", tokenizer="words")
    paths = {"target": str(pair.target), "draft": str(pair.draft)}
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "real_pair"
    ]
    assert len(calls) == 1
    calls[0].func = ast.Name("EngineConfig", ast.Load())
    calls[0].keywords += [ast.keyword(k, ast.Constant(v)) for k, v in paths.items()]
    namespace = {"__name__": "readme", "EngineConfig": EngineConfig}
    exec(compile(ast.fix_missing_locations(tree), "README.md", "exec"), namespace)
    # the streamed tokens' text, then the chat's finish reason and its decode rate
    streamed, finish, rate = capsys.readouterr().out.rsplit(maxsplit=2)
    assert streamed.strip() and finish in ("stop", "length") and float(rate) > 0
