import pytest

from lever_actors.policy.calibration import SURE, AcceptanceCalibrator
from lever_actors.policy.lookup import LOOKUP_RANK


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


def test_copies_learn_a_rate_of_their_own():
    calibrator = AcceptanceCalibrator()
    before = calibrator.acceptance(0.0, 0), calibrator.copy_acceptance()
    # chain 0, 1; below 1 a drafted node 2 (rejected) and a copied node 3 (accepted)
    calibrator.observe((-1, 0, 1, 1), (1.0, 1.0, 0.05, 0.0), (0, 0, 0, LOOKUP_RANK), 2, (0, 1, 3))
    assert calibrator.acceptance(0.0, 0) < before[0]  # the drafted node's bin only
    assert calibrator.copy_acceptance() > before[1]
    assert (calibrator.copies_offered, calibrator.copies_accepted) == (1, 1)
