"""Acceptance calibrators in a known state, for tests of the tree policies."""

from __future__ import annotations

from lever_actors.policy.calibration import PER_RANK, AcceptanceCalibrator


def learned(rate: float) -> AcceptanceCalibrator:
    """A calibrator that saw every kind of draft node accepted at `rate`."""
    offered = [100.0] * 2 * PER_RANK
    return AcceptanceCalibrator(offered=offered, accepted=[rate * n for n in offered])
