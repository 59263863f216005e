"""A tiny target (as a flash layout) and draft made with transformers' classes, and prompts
as token ids: the harness runs end to end on them without a tokenizer."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch

from lever_actors.bench.harness import PromptSet, Workload
from lever_actors.checkpoints.convert import convert
from lever_actors.cli.bench import add_bench_arguments
from tests.tiny_hf import save_tiny, tiny_model

PROMPT_SETS = [
    PromptSet("humaneval", [[3, 14, 15, 92, 65], [2, 71, 82, 81, 82, 84, 59]]),
    PromptSet("sharegpt", [[1, 41, 42, 13], [27, 18, 28, 18, 28, 45, 90, 45]]),
]


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target flash layout in float32, draft HF directory) sharing a 97-token vocabulary."""
    root = tmp_path_factory.mktemp("pair")
    target_hf = save_tiny(tiny_model("qwen2", layers=8), root / "target-hf")
    layout = root / "target"
    convert(target_hf, layout, torch.float32)
    draft = save_tiny(tiny_model("qwen2", seed=1, layers=1), root / "draft-hf")
    return layout, draft


@pytest.fixture(scope="session")
def workload(tiny_pair) -> Workload:
    """Both prompt sets, two prompts each, on the tiny pair; no stop tokens."""
    target, draft = tiny_pair
    return Workload(target, draft, PROMPT_SETS, frozenset())


@pytest.fixture(scope="session")
def one_set(workload) -> Workload:
    """The workload's first prompt set only."""
    return dataclasses.replace(workload, prompt_sets=PROMPT_SETS[:1])


@pytest.fixture
def bench_parser(tmp_path) -> argparse.ArgumentParser:
    """The bench command's options, with the cache directory the top-level parser adds."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-dir", type=Path, default=tmp_path)
    add_bench_arguments(parser)
    return parser
