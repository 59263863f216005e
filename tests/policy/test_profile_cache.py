"""The start-up profile is measured once per target layout, plan, draft and machine, then
read back; anything else measures anew."""

from __future__ import annotations

import msgspec
import pytest

from lever_actors.config import EngineConfig
from lever_actors.engine import Engine
from lever_actors.policy import setup as policy_setup
from lever_actors.policy.cost_model import CostModel, Curve
from lever_actors.policy.profile_cache import cached_costs
from lever_actors.testing import TINY_ARGS, budget_bytes, model_pair

COST = CostModel(
    flash_bandwidth=1e9,
    streamed_bytes=10,
    verify=Curve([1, 2], [0.1, 0.2]),
    draft=Curve([1], [0.01]),
    project_seconds=0.001,
    head_pass_seconds=0.0,
)


def test_a_saved_profile_is_read_back_and_a_damaged_one_measured_again(tmp_path):
    measured: list[int] = []

    def profile() -> CostModel:
        measured.append(1)
        return COST

    assert cached_costs(tmp_path, "k", profile) == COST
    assert cached_costs(tmp_path, "k", profile) == COST
    assert len(measured) == 1
    (tmp_path / "k.msgpack").write_bytes(b"\x00not a profile")
    assert cached_costs(tmp_path, "k", profile) == COST
    assert len(measured) == 2
    assert cached_costs(tmp_path, "k", profile) == COST
    assert len(measured) == 2  # the replacement reads back


def test_a_resident_profiles_unbounded_bandwidth_survives_the_round_trip(tmp_path):
    resident = msgspec.structs.replace(COST, flash_bandwidth=float("inf"))
    cached_costs(tmp_path, "k", lambda: resident)
    assert cached_costs(tmp_path, "k", lambda: COST).flash_bandwidth == float("inf")


@pytest.fixture
def profiles(tmp_path, monkeypatch) -> list[object]:
    """Each start-up profile measured (the cache in a fresh directory)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured: list[object] = []
    profile = policy_setup.profile_costs

    def counted(*args, **kwargs):
        measured.append(args[0].plan.streamed_layers)
        return profile(*args, **kwargs)

    monkeypatch.setattr(policy_setup, "profile_costs", counted)
    return measured


async def test_an_engine_opens_without_measuring_again_unless_its_plan_changes(profiles):
    pair = model_pair(msgspec.structs.replace(TINY_ARGS, n_layers=4), "perturbed", 0)
    config = EngineConfig(target=str(pair.target), draft=str(pair.draft))
    for budget in ("all", "all", budget_bytes(pair.target, 0.0)):
        async with Engine.open(msgspec.structs.replace(config, dram_budget=budget)) as engine:
            tokens = (await engine.generate([1, 2, 3], max_new_tokens=4)).tokens
            assert len(tokens) == 4
    assert len(profiles) == 2  # all layers resident, then every layer streamed
    assert profiles[0] == () and profiles[1] != ()
