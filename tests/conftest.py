"""Hypothesis profiles for the property tests, chosen by HYPOTHESIS_PROFILE, and the
fixtures several test modules share.

ci (the default): reproducible (derandomized) and sized to finish in minutes.
thorough: 1,000 examples a property (about seventeen times ci's), freshly random on every run,
failures kept in the example database for replay:

    HYPOTHESIS_PROFILE=thorough .venv/bin/pytest tests/test_exactness.py
"""

import os

import pytest
from hypothesis import HealthCheck, settings

from lever_actors.paths import default_cache_dir
from lever_actors.policy import cost_model
from lever_actors.policy import setup as policy_setup

settings.register_profile(
    "ci",
    max_examples=60,  # per property test; tests/test_exactness.py scales it per test
    deadline=None,  # one example opens an engine: tens of ms, with outliers on a busy machine
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "thorough",
    parent=settings.get_profile("ci"),
    max_examples=1000,
    derandomize=False,
    database=settings.get_profile("default").database,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="session")
def own_cache_dir(tmp_path_factory):
    """The tests' caches (start-up profiles, draft snapshots, spilled rows) in a directory
    of their own, so that they neither read the user's nor crowd theirs out (the snapshots
    keep the 4 latest); the compiled kernels, the same for every caller, are shared."""
    kernels = default_cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    base = tmp_path_factory.mktemp("cache")
    (base / "lever_actors").mkdir()
    (base / "lever_actors" / "kernels").symlink_to(kernels)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(base))
        yield


@pytest.fixture
def slow_flash(monkeypatch):
    """The cost model believes flash reads 1 MB/s and never learns otherwise (no step's
    reads teach it the bandwidth, no pass counts as waiting on flash), so gain-cost trees
    grow as a phone's would, to their cap, however fast or busy this machine is."""
    profile = policy_setup.machine_costs
    observe = cost_model.CostModel.observe

    def profiled(*args, **kwargs):
        cost = profile(*args, **kwargs)
        cost.flash_bandwidth = 1e6
        return cost

    def observe_all_but_bandwidth(cost, step):
        believed = cost.flash_bandwidth
        observe(cost, step)
        cost.flash_bandwidth = believed

    monkeypatch.setattr(policy_setup, "machine_costs", profiled)
    monkeypatch.setattr(cost_model.CostModel, "observe", observe_all_but_bandwidth)
    monkeypatch.setattr(cost_model, "IO_BOUND_WAIT", float("inf"))
