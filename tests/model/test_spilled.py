"""A draft's table with the rows above the ids it proposes on disk (model/spilled.py): its
lookups give the whole table's rows, its DRAM holds the rest, its file is written once."""

from __future__ import annotations

import pytest
import torch

from lever_actors.checkpoints.quantize import quantize_q6k
from lever_actors.model.quantized import quantize_int4, quantize_int8
from lever_actors.model.spilled import SpilledTable, spill_rows


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "lever_actors" / "spilled-rows"


def table(quantize=quantize_int8, rows: int = 96):
    return quantize(torch.randn(rows, 256, generator=torch.Generator().manual_seed(4)))


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_q6k])
def test_lookups_give_the_whole_tables_rows(quantize):
    whole = table(quantize)
    spilled = spill_rows(whole, 40)
    assert isinstance(spilled, SpilledTable) and spilled.resident.shape == (40, 256)
    for ids in ([5, 70, 39, 40, 95, 5], [3, 0], [41], []):
        ids = torch.tensor(ids, dtype=torch.int64)
        assert torch.equal(spilled[ids], whole[ids])
    assert torch.equal(spilled.resident[torch.arange(40)], whole[torch.arange(40)])


def test_dram_holds_the_resident_rows_and_the_file_the_rest(cache):
    whole = table()
    spilled = spill_rows(whole, 40)
    assert spilled.nbytes == whole.nbytes * 40 // 96 + 56 * 2  # 56 bf16 scales stay
    (file,) = cache.iterdir()
    assert file.stat().st_size == 56 * 256  # int8 rows
    again = spill_rows(whole, 40)  # the same rows: the same file, written once
    assert list(cache.iterdir()) == [file] and torch.equal(
        again[torch.tensor([90])], whole[torch.tensor([90])]
    )


def test_a_dense_table_spills_its_rows_as_they_are():
    whole = torch.randn(96, 256, dtype=torch.float64)
    spilled = spill_rows(whole, 40)
    ids = torch.tensor([95, 2, 40])
    assert torch.equal(spilled[ids], whole[ids]) and spilled.dtype == torch.float64
    assert spilled.nbytes == 40 * 256 * 8


def test_tables_it_cannot_read_by_rows_or_with_no_rows_past_stay_whole(cache):
    assert spill_rows(table(), 96) is None and spill_rows(table(), None) is None
    assert spill_rows(table(quantize_int4), 40) is None  # a 4-bit packing
    assert not cache.exists()
