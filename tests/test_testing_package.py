"""lever_actors.testing as a library user meets it: the checkpoints and the oracle import
without hypothesis (a dev extra), the strategies say how to install it, and a wrong engine
output is reported at the first token that differs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lever_actors.testing as testing
from lever_actors.config import EngineConfig
from lever_actors.testing import TINY_ARGS, oracle, strategies

ROOT = Path(__file__).resolve().parents[1]


WITHOUT_HYPOTHESIS = textwrap.dedent(
    """
    import sys

    sys.modules["hypothesis"] = None  # as if it were not installed: importing it fails

    import trio

    import lever_actors.testing as testing
    from lever_actors.config import EngineConfig
    
    pair = testing.model_pair(testing.TINY_ARGS, "perturbed")
    config = EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="chain:2")
    trio.run(testing.assert_matches_sequential, config, [1, 2, 3], 4)
    try:
        testing.engine_cases
    except ImportError as error:
        print(error)
    else:
        sys.exit("engine_cases came without hypothesis")
    """
)


def test_checkpoints_and_oracle_work_without_hypothesis() -> None:
    run = subprocess.run(
        [sys.executable, "-c", WITHOUT_HYPOTHESIS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "hypothesis" in run.stdout
    assert "pip install 'lever-actors[dev]'" in run.stdout


def test_every_public_name_imports_and_strategies_are_the_strategies_modules() -> None:
    for name in testing.__all__:
        assert getattr(testing, name) is not None
    assert testing.engine_cases is strategies.engine_cases
    assert testing.EngineCase is strategies.EngineCase
    assert set(testing.__all__) <= set(dir(testing))
    with pytest.raises(AttributeError):
        testing.no_such_name  # noqa: B018


async def test_mismatch_report_names_first_differing_token(monkeypatch) -> None:
    pair = testing.model_pair(TINY_ARGS, "identical")
    config = EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="chain:2")
    right = testing.reference_tokens(pair.target, [1, 2, 3], 4)
    wrong = [*right[:2], (right[2] + 1) % TINY_ARGS.vocab_size, right[3]]
    monkeypatch.setattr(oracle, "reference_tokens", lambda *_: wrong)
    with pytest.raises(AssertionError) as failure:
        await testing.assert_matches_sequential(config, [1, 2, 3], 4)
    report = str(failure.value)
    assert "differs from sequential greedy decoding of the target at new token 2" in report
    assert f"agreed:   {right[:2]}" in report
    assert f"engine:   ...{right[2:]}" in report
