"""A GGUF draft is converted once: later loads read its snapshot, which computes bit for bit
what the conversion does; a changed source or a damaged snapshot means a fresh conversion."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lever_actors.checkpoints.load as checkpoints
from lever_actors.checkpoints.snapshot import KEPT
from lever_actors.draft import load_draft
from tests.checkpoints.test_gguf import write_gguf

TOKENS = torch.tensor([1, 7, 3, 30, 2])


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "lever_actors" / "snapshots"


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """The GGUF files converted, as they are."""
    seen: list[Path] = []
    convert = checkpoints.load_gguf

    def counted(path, *args, **kwargs):
        seen.append(path)
        return convert(path, *args, **kwargs)

    monkeypatch.setattr(checkpoints, "load_gguf", counted)
    return seen


def logits(draft) -> torch.Tensor:
    model = draft.model
    return model.logits(model.forward(TOKENS, model.new_cache(len(TOKENS))))


@pytest.mark.parametrize(
    ("dtype", "weights"), [("bfloat16", "auto"), ("bfloat16", "q8"), ("float32", "dense")]
)
def test_a_second_load_reads_the_snapshot_and_computes_the_same(
    tmp_path, conversions, dtype, weights
):
    path = tmp_path / "draft.gguf"
    write_gguf(path, tokens=[chr(c) for c in range(33, 127)] + ["<|im_end|>"])
    first = load_draft(str(path), dtype, weights)
    again = load_draft(str(path), dtype, weights)
    assert conversions == [path]
    assert torch.equal(logits(first), logits(again))
    assert again.dram_bytes == first.dram_bytes
    assert again.tokenizer is not None and again.tokenizer.encode("ab") == [64, 65]


def test_a_changed_source_is_converted_again(tmp_path, conversions):
    path = tmp_path / "draft.gguf"
    write_gguf(path)
    load_draft(str(path), "bfloat16")
    write_gguf(path, tied=True)
    tied = load_draft(str(path), "bfloat16")
    assert conversions == [path, path]
    assert tied.model.weights.lm_head is not None
    assert load_draft(str(path), "bfloat16").model.args == tied.model.args
    assert len(conversions) == 2


def test_a_damaged_snapshot_is_replaced(tmp_path, cache, conversions):
    path = tmp_path / "draft.gguf"
    write_gguf(path)
    expected = logits(load_draft(str(path), "bfloat16"))
    [snapshot] = cache.iterdir()
    weights = snapshot / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert torch.equal(logits(load_draft(str(path), "bfloat16")), expected)
    assert len(conversions) == 2
    assert torch.equal(logits(load_draft(str(path), "bfloat16")), expected)
    assert len(conversions) == 2  # the replacement loads


def test_only_the_most_recently_used_snapshots_stay(tmp_path, cache, conversions):
    paths = [tmp_path / f"draft{i}.gguf" for i in range(KEPT + 1)]
    for path in paths:
        write_gguf(path)
        load_draft(str(path), "bfloat16")
    assert len(list(cache.iterdir())) == KEPT
    load_draft(str(paths[-1]), "bfloat16")
    load_draft(str(paths[0]), "bfloat16")  # the oldest: gone, converted again
    assert conversions == [*paths, paths[0]]
