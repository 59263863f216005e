"""The target on the plain path (plain_target.py): read from its layout without torch, it
computes what the torch model of the same layout computes, with its embedding table in DRAM
or read a row at a time from flash; a corrupt byte is refused before it is used."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.errors import CorruptLayoutError
from lever_actors.model.plain_model import token_stream
from lever_actors.model.sequential import sequential_cached
from lever_actors.model.transformer import Transformer
from lever_actors.plain_target import PlainTarget, embed_bytes
from lever_actors.testing import model_pair
from lever_actors.testing.checkpoints import bf16_args
from tests.model.test_plain import needs_native
from tests.reliability.test_integrity import flip_byte, tensor_start

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def layout():
    return model_pair(bf16_args(), "identical", dtype=torch.bfloat16, weights="q4k").target


@needs_native
@pytest.mark.parametrize("embed_resident", [True, False])
def test_the_plain_target_decodes_the_torch_models_tokens(layout, embed_resident):
    checkpoint = load_checkpoint(layout, torch.bfloat16)
    theirs = sequential_cached(Transformer(checkpoint.args, checkpoint.weights), PROMPT, 12)
    target = PlainTarget(layout, embed_resident=embed_resident)
    try:
        assert list(token_stream(target.model, PROMPT, 12)) == theirs
        whole = target.manifest.file_bytes
        assert target.bytes_read == (
            whole if embed_resident else whole - embed_bytes(target.manifest)
        )
    finally:
        target.close()


@needs_native
def test_streamed_rows_equal_the_tables(layout):
    resident, streamed = PlainTarget(layout), PlainTarget(layout, embed_resident=False)
    try:
        ids = [0, 5, 5, 63]
        np.testing.assert_array_equal(
            streamed.model.weights.embed.rows(ids), resident.model.weights.embed.rows(ids)
        )
    finally:
        resident.close(), streamed.close()


def test_a_corrupt_layer_is_refused_before_the_plain_path_uses_it(tmp_path, layout):
    copy = tmp_path / "layout"
    shutil.copytree(layout, copy)
    flip_byte(copy, tensor_start(copy, "layer.1", "wq") + 7)
    with pytest.raises(CorruptLayoutError, match="checksum mismatch in tensor 'wq'"):
        PlainTarget(copy)
