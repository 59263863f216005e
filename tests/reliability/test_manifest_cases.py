"""Flash-layout manifests with fields out of range or disagreeing with their args: a
CheckpointError naming the manifest and the field, before any weight is read."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.device.manifest import MANIFEST_NAME
from lever_actors.errors import CheckpointError
from tests.reliability.tiny import assert_consistent, edit_json, write_hf


@pytest.fixture(scope="module")
def base_layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("layout")
    convert(write_hf(root / "hf"), root / "flash", torch.float64)
    return root / "flash"


@pytest.fixture
def layout(base_layout: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(base_layout, tmp_path / "flash"))


def _args(**values: Any) -> Callable[[dict], None]:
    return lambda m: m["args"].update(values)


def _extent(i: int, **values: Any) -> Callable[[dict], None]:
    return lambda m: m["extents"][i].update(values)


def _tensor(i: int, j: int, **values: Any) -> Callable[[dict], None]:
    return lambda m: m["extents"][i]["tensors"][j].update(values)


def _shift(i: int, field: str, by: int) -> Callable[[dict], None]:
    return lambda m: m["extents"][i].update({field: m["extents"][i][field] + by})


def test_the_unchanged_layout_loads(layout: Path) -> None:
    assert_consistent(load_checkpoint(layout, torch.float64))


# extents: 0 embed, 1 layer.0, 2 layer.1, 3 final_norm, 4 lm_head; layer tensors in
# layer_tensor_names order (attn_norm, wq, wk, ...)
CASES = [
    (_args(n_heads=0), "n_heads = 0 is not positive"),
    (_args(n_kv_heads=3), "n_kv_heads = 3 does not divide n_heads = 4"),
    (_args(norm_eps=-1.0), "norm_eps = -1.0 is not in (0, 1.0)"),
    (_args(norm_eps=1), "norm_eps = 1.0 is not in (0, 1.0)"),
    (_args(rope_theta=0), "rope_theta = 0.0 is not finite and positive"),
    (_args(rope_scaling={"kind": "linear", "factor": 0.0}), "rope_scaling.factor = 0.0 is not"),
    (_args(arch="gemma"), "invalid manifest"),
    (_args(n_layers=10**15), "5 extents, but n_layers = 1000000000000000"),
    (_args(tie_embeddings=True), "5 extents, but n_layers = 2 and tie_embeddings = True make 4"),
    (_args(d_model=8), "tensor 'embed' of embed: shape (32, 16), args imply (32, 8)"),
    (lambda m: m.update(dtype="int8"), "dtype 'int8' is not one of bfloat16"),
    (_extent(1, key="layer.7"), "no extent 'layer.0' (unexpected extent 'layer.7')"),
    (_extent(2, key="layer.0"), "no extent 'layer.1' (a key is repeated)"),
    (_shift(1, "offset", 100), "extent layer.0: offset = 4196 is not a non-negative multiple"),
    (_extent(0, nbytes=-4096), "extent embed: nbytes = -4096 is not a non-negative multiple"),
    (lambda m: m["extents"][1]["tensors"].pop(), "extent layer.0: holds tensors"),
    (_tensor(1, 0, name="wq"), "extent layer.0: holds tensors"),
    (_tensor(3, 0, dtype="float32"), "'final_norm' of final_norm: dtype 'float32', the layout's"),
    (_tensor(2, 0, shape=[-16]), "'attn_norm' of layer.1: shape (-16,), args imply (16,)"),
    (_tensor(4, 0, nbytes=4104), "'lm_head' of lm_head: nbytes = 4104, its shape, dtype and"),
    (_tensor(4, 0, format="int4"), "'lm_head' of lm_head: int4 needs inputs in groups of 32"),
    (_tensor(4, 0, format="int5"), "invalid manifest"),
    (_tensor(1, 2, offset=-64), "'wk' of layer.0: offset = -64 is negative"),
    (_tensor(1, 2, offset=10**9), "'wk' of layer.0 ends at byte 1000001024, past the end of its"),
    (_tensor(0, 0, chunk_checksums=[]), "'embed' of embed: 0 chunk checksums, its 4096 bytes"),
]


@pytest.mark.parametrize(("edit", "fragment"), CASES)
def test_bad_manifest_fields_are_named(layout: Path, edit, fragment: str) -> None:
    edit_json(layout / MANIFEST_NAME, edit)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(layout, torch.float64)
    assert str(layout / MANIFEST_NAME) in str(err.value)
    assert fragment in str(err.value)
