"""Whether a request runs on the plain path (plan/plain.py): each refusal names its reason,
and the memory plan keeps the layers and the LM head, the embedding table where it fits."""

from __future__ import annotations

import msgspec
import pytest
import torch

from lever_actors.config import EngineConfig
from lever_actors.device.manifest import read_manifest
from lever_actors.model import kernel_build
from lever_actors.model.args import RopeScaling
from lever_actors.plan import plain
from lever_actors.plan.memory import MemoryPlan, Reading
from lever_actors.policy import plain_copies
from lever_actors.testing import model_pair
from lever_actors.testing.checkpoints import bf16_args


def layout(weights: str = "q4k", **args):
    model = msgspec.structs.replace(bf16_args(), **args)
    return model_pair(model, "identical", dtype=torch.bfloat16, weights=weights).target


@pytest.fixture(scope="module")
def q4k():
    return layout()


def config(target, **fields) -> EngineConfig:
    return EngineConfig(target=str(target), **{"plan": "ar", **fields})


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"plan": "trees"}, "the plan trees runs on the engine"),
        ({"plan": "lookup"}, ""),
        ({"plan": "auto"}, ""),
        ({"trace": "t.msgpack", "throttle": "ufs4.0"}, "trace, throttle asks for"),
        ({"dram_budget": "all"}, "dram_budget asks for the engine"),
        ({"parallel": 4}, "parallel asks for the engine"),
        ({}, ""),
    ],
)
def test_a_refusal_names_what_asks_for_the_engine(q4k, fields, why):
    manifest = read_manifest(q4k)
    found = plain.refusal(config(q4k, **fields), manifest)
    assert found.startswith(why) if why else found == ""


def test_models_and_formats_the_plain_path_cannot_run_are_refused():
    llama3 = layout(rope_scaling=RopeScaling("llama3", factor=8.0))
    assert "llama3's rope scaling" in plain.refusal(config(llama3), read_manifest(llama3))
    dense = layout("dense")
    assert "is a dense matrix" in plain.refusal(config(dense), read_manifest(dense))


def test_amx_keeps_int8_matrices_on_its_tiles(monkeypatch):
    q8 = layout("q8")
    supported = kernel_build.supported
    monkeypatch.setattr(
        kernel_build,
        "supported",
        lambda isas=kernel_build.ISAS: (
            (kernel_build.AMX, "") if kernel_build.AMX in isas else supported(isas)
        ),
    )
    assert "AMX's tiles" in plain.refusal(config(q8), read_manifest(q8))


@pytest.mark.parametrize(
    ("spare", "planned"), [(1 << 30, (True, True)), (-1, (True, False)), (None, None)]
)
def test_the_memory_plan_keeps_the_layers_and_the_table_where_it_fits(
    q4k, monkeypatch, spare, planned
):
    manifest = read_manifest(q4k)
    table = manifest.extent("embed").nbytes
    budget = {1 << 30: manifest.file_bytes, -1: manifest.file_bytes - table}.get(spare, 0)
    made = MemoryPlan(1 << 33, 0, 0, 0, 1024, 1 << 20, budget, True)
    monkeypatch.setattr(plain, "memory_plan", lambda *args, **kwargs: made)
    found, why = plain.plain_memory(config(q4k), manifest)
    if planned is None:
        assert found is None and why.endswith("the layers and the LM head would stream")
    else:
        assert found is not None and (True, found.embed_resident) == planned


def test_auto_takes_the_plain_path_wherever_it_holds_the_target_draft_or_none(q4k, tmp_path):
    draft = tmp_path / "draft.gguf"
    with open(draft, "wb") as sparse:
        sparse.truncate(1 << 20)  # it would fit beside the whole target in the engine
    for auto in (config(q4k, plan="auto", draft=str(draft)), config(q4k, plan="auto")):
        found, reason = plain.plain_memory(auto, read_manifest(q4k))
        assert found is not None and reason == ""


@pytest.mark.parametrize(
    ("fields", "copies"),
    [
        ({}, 0),
        ({"plan": "lookup"}, plain_copies.CAP),
        ({"plan": "lookup", "tree": "lookup:5"}, 5),
        ({"plan": "auto"}, plain_copies.CAP),
    ],
)
def test_lookup_and_auto_copy_from_the_text_and_ar_takes_one_token_a_pass(q4k, fields, copies):
    found, _ = plain.plain_memory(config(q4k, **fields), read_manifest(q4k))
    assert found is not None and found.copies == copies
    assert found.name == ("lookup" if copies else "ar")


def test_the_memory_plan_counts_what_is_coming_and_leaves_out_the_weights_placed(q4k, monkeypatch):
    seen = []
    made = MemoryPlan(1 << 33, 0, 0, 0, 1024, 1 << 20, 1 << 40, True)
    monkeypatch.setattr(plain, "read_process", lambda: Reading(1 << 33, 100 << 20, 0))
    monkeypatch.setattr(
        plain, "memory_plan", lambda c, m, reading, **k: seen.append(reading) or made
    )
    plain.plain_memory(config(q4k), read_manifest(q4k), coming=30 << 20, placed=50 << 20)
    assert [r.process for r in seen] == [80 << 20]
