"""Fuzz the flash-layout manifest reader: random JSON values, nudged numbers and deletions
anywhere in a valid manifest. Every case ends in a CheckpointError or in a checkpoint whose
shapes agree with its args; nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.device.manifest import MANIFEST_NAME
from tests.reliability.fuzz import DELETE, edited, examples, json_values, load_or_refuse, paths
from tests.reliability.tiny import write_hf


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("manifest-fuzz")
    convert(write_hf(root / "hf"), root / "flash", torch.float64)
    return root / "flash"


@pytest.fixture(scope="module")
def original(layout: Path) -> dict:
    return json.loads((layout / MANIFEST_NAME).read_text())


@examples(0.4)
@given(data=st.data())
def test_random_manifest_fields(layout: Path, original: dict, data: st.DataObject) -> None:
    manifest = original
    every_path = list(paths(original))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(every_path[1:]))  # the whole manifest kept a dict
        nudged = st.nothing()
        old = _at(original, path)
        if isinstance(old, int) and not isinstance(old, bool):
            # near the real value: an offset or size off by a little, a count off by one
            nudged = st.integers(-4096, 4096).map(lambda d, old=old: old + d)
        try:
            manifest = edited(manifest, path, data.draw(nudged | json_values | st.just(DELETE)))
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed or replaced the part this path led into
    (layout / MANIFEST_NAME).write_text(json.dumps(manifest))
    load_or_refuse(lambda: load_checkpoint(layout, torch.float64))


def _at(value, path):
    for key in path:
        value = value[key]
    return value
