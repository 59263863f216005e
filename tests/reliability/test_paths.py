"""File names read from a checkpoint's own metadata stay inside its directory."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.errors import CheckpointError
from lever_actors.testing import TINY_ARGS, flash_layout, tiny_checkpoint


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", ""])
def test_an_hf_index_naming_a_shard_outside_is_refused(tmp_path, shard):
    directory = tmp_path / "hf"
    shutil.copytree(tiny_checkpoint(TINY_ARGS), directory)
    weights = directory / "model.safetensors"
    index = {"weight_map": {"model.embed_tokens.weight": shard}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    weights.unlink()
    with pytest.raises(CheckpointError, match="weight_map shard"):
        load_checkpoint(directory, torch.float64)


@pytest.mark.parametrize("name", ["../tokenizer.json", "/etc/passwd"])
def test_a_manifest_naming_a_tokenizer_outside_is_refused(tmp_path, name):
    layout = tmp_path / "layout"
    shutil.copytree(flash_layout(tiny_checkpoint(TINY_ARGS, tokenizer="words")), layout)
    manifest = json.loads((layout / "manifest.json").read_text())
    manifest["tokenizer"] = name
    (layout / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest tokenizer"):
        load_checkpoint(layout, torch.float64)
