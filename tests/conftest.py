"""Hypothesis profiles for the property tests, chosen by HYPOTHESIS_PROFILE.

ci (the default): reproducible (derandomized) and sized to finish in minutes.
thorough: ten times the examples, freshly random on every run, failures kept in the
example database for replay:

    HYPOTHESIS_PROFILE=thorough .venv/bin/pytest tests/test_exactness.py
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=120,  # per property test; tests/test_exactness.py scales it per test
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
