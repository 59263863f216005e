import pytest

from lever_actors.policy.calibration import SURE, AcceptanceCalibrator


def offer(calibrator: AcceptanceCalibrator, prob: float, accepted: bool) -> None:
    """One first-choice node below an accepted root (node 0)."""
    calibrator.observe((-1, 0), (1.0, prob), (0, 0), 1, (0, 1) if accepted else (0,))


def test_sure_first_choices_are_judged_apart_from_the_rest_of_the_top_bin():
    calibrator = AcceptanceCalibrator()
    for i in range(50):
        offer(calibrator, 0.995, accepted=True)
        offer(calibrator, 0.93, accepted=i % 5 != 0)  # 80% accepted
    assert calibrator.acceptance(0.999, 0) > 0.99
    assert calibrator.acceptance(0.93, 0) == pytest.approx(0.8, abs=0.03)
    assert calibrator.acceptance(SURE - 1e-6, 0) == calibrator.acceptance(0.9, 0)


@pytest.mark.parametrize("probs", [[0.5, 0.49, 0.01], [0.34, 0.33, 0.33], [0.2] * 5])
def test_a_nodes_children_never_claim_more_than_one_acceptance(probs):
    """Each estimate alone is its bin's middle, so siblings alone would claim more than 1
    (the target takes one token after their parent)."""
    calibrator = AcceptanceCalibrator()
    alone = [calibrator.acceptance(p, rank) for rank, p in enumerate(probs)]
    assert sum(alone) > 1
    ranked = calibrator.ranked(probs)
    assert sum(ranked) == pytest.approx(1.0)
    assert ranked[0] == alone[0]  # the best child is never cut
    assert all(0 <= r <= a for r, a in zip(ranked, alone, strict=True))
