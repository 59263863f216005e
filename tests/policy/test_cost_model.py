import msgspec
import pytest

from lever_actors.channels.messages import Beside, StepStats
from lever_actors.policy.cost_model import CostModel, Curve

GB = 10**9


def model(bandwidth: float = 1.0 * GB, streamed: int = 1 * GB, head: int = GB // 4) -> CostModel:
    return CostModel(
        flash_bandwidth=bandwidth,
        streamed_bytes=streamed,
        verify=Curve([1, 64], [0.1, 0.6]),
        draft=Curve([1, 8], [0.05, 0.1]),
        project_seconds=0.001,
        head_pass_seconds=0.0,
        head_bytes=head,
    )


def step(
    nodes: int, *, io_wait: float, verify: float, read: tuple[int, float], probe: float = 0.0
) -> StepStats:
    return StepStats(
        step=1,
        tree_nodes=nodes,
        live_nodes=nodes,
        pruned=0,
        saved_node_layers=0,
        probe_seconds=probe,
        audited=False,
        false_prunes=0,
        projected_nodes=nodes,
        drafted_ahead=0,
        draft_rounds=(1,),
        draft_seconds=0.05,
        io_wait_seconds=io_wait,
        verify_seconds=verify,
        project_seconds=0.3,
        new_tokens=2,
        step_seconds=0.35 + io_wait + verify,
        bytes_read=read[0],
        read_seconds=read[1],
    )


def test_a_pass_stretched_by_its_compute_does_not_teach_a_slower_flash():
    """A big tree's pass took 1.6 s, a third of it waiting for layers, while the reads ran
    at the profiled 1 GB/s: the flash is as fast as before, the tree was dear."""
    cost = model()
    for _ in range(20):
        cost.observe(step(48, io_wait=0.55, verify=1.05, read=(GB + GB // 4, 1.25)))
    assert cost.flash_bandwidth == pytest.approx(1.0 * GB)
    assert not cost.io_bound(48)  # the verify curve learned the compute instead


def test_the_bandwidth_follows_the_reads():
    cost = model()
    for _ in range(40):
        cost.observe(step(4, io_wait=1.9, verify=0.1, read=(GB, 2.0)))
    assert cost.flash_bandwidth == pytest.approx(0.5 * GB, rel=1e-3)
    assert cost.io_seconds == pytest.approx(2.0, rel=1e-3)
    assert cost.head_read_seconds == pytest.approx(0.5, rel=1e-3)  # the same bytes/s


def test_a_step_without_reads_leaves_the_bandwidth_alone():
    cost = model()
    cost.observe(step(4, io_wait=0.0, verify=0.1, read=(0, 0.0)))
    assert cost.flash_bandwidth == 1.0 * GB


def test_a_resident_model_learns_no_bandwidth_from_stray_reads():
    cost = model(float("inf"), streamed=0, head=0)
    cost.observe(step(4, io_wait=0.0, verify=0.1, read=(4096, 0.001)))
    assert cost.flash_bandwidth == float("inf")
    assert cost.io_seconds == 0.0 and cost.head_read_seconds == 0.0


def test_a_streamed_head_beside_resident_layers_learns_the_bandwidth_from_its_reads():
    """No layer streams, so start-up measured no bandwidth; the head's reads give one."""
    cost = model(float("inf"), streamed=0)
    resident_head = model(float("inf"), streamed=0, head=0)
    # before any read, a streamed head still projects every node, not the expected path;
    # and its reads slow the layers' compute beside them
    extra = cost.step_seconds(9, [1], 1.0) - resident_head.step_seconds(9, [1], 1.0)
    assert extra == pytest.approx(8 * cost.project_seconds + cost.contention * cost.verify(9))
    cost.observe(step(4, io_wait=0.0, verify=0.1, read=(GB // 4, 0.5)))
    assert cost.flash_bandwidth == pytest.approx(0.5 * GB)
    assert cost.head_read_seconds == pytest.approx(0.5)


def test_everything_resident_a_pass_reads_the_head_once_and_nothing_slows_its_compute():
    """Nothing streamed, no reads contend with the compute; the head's pass over its weights
    is paid once a step, its products once per token along the path."""
    resident = msgspec.structs.replace(
        model(streamed=0, head=0), head_pass_seconds=0.01, overhead_seconds=0.002
    )
    assert resident.pass_compute_seconds(4) == resident.verify(4)
    one, three = resident.step_seconds(4, [], 1.0), resident.step_seconds(4, [], 3.0)
    assert one == pytest.approx(resident.verify(4) + 0.01 + 0.001 + 0.002)
    assert three - one == pytest.approx(2 * resident.project_seconds)
    streaming = model(streamed=GB, head=0)
    assert streaming.pass_compute_seconds(4) == pytest.approx(1.2 * streaming.verify(4))


def curve() -> Curve:
    return Curve([1, 16, 32, 64], [0.1, 0.3, 0.5, 0.9])


def test_the_verify_curve_learns_the_sizes_its_passes_have():
    """Passes of 48 nodes computed three times the profile: the points at 32 and 64 learn
    it, the ones small trees use follow the machine's pace a few percent a pass."""
    learned = curve()
    learned.learn(48, 2.1, 0.5)
    assert learned.seconds[:2] == [pytest.approx(0.1, rel=0.03), pytest.approx(0.3, rel=0.03)]
    for _ in range(30):
        learned.learn(48, 2.1, 0.5)
    assert learned(48) == pytest.approx(2.1, rel=1e-3)
    assert learned.seconds == sorted(learned.seconds)


def test_a_cheaper_pass_lowers_the_points_below_it():
    learned = curve()
    for _ in range(30):
        learned.learn(64, 0.2, 0.5)
    assert learned(64) == pytest.approx(0.2, rel=1e-3)
    assert learned.seconds == sorted(learned.seconds)
    assert learned.seconds[0] <= 0.1  # below 0.2 already, and the pace is faster


def test_a_size_outside_the_points_moves_the_nearest_segment():
    learned = curve()
    learned.learn(100, 2 * curve()(100), 0.5)
    assert learned(100) == pytest.approx(1.5 * curve()(100))
    assert learned.seconds[:2] == [pytest.approx(0.1, rel=0.02), pytest.approx(0.3, rel=0.02)]
    learned = curve()
    learned.learn(0.5, 0.1, 0.5)  # measured twice what the first point's line says
    assert learned.seconds[0] == pytest.approx(0.15)
    assert learned.seconds[1:] == pytest.approx([0.3, 0.5, 0.9], rel=0.02)


def test_a_few_dear_passes_teach_their_size():
    """A 64-token request under 1 GiB runs 8-16 steps: three compute-bound passes of 48 nodes
    at twice the profile bring the prediction within 10% of it."""
    cost = model()
    cost.verify = curve()
    measured = 2 * cost.verify(48)
    for _ in range(3):
        cost.observe(step(48, io_wait=0.0, verify=measured, read=(GB, 1.0)))
    assert cost.verify(48) == pytest.approx(measured, rel=0.1)
    assert cost.verify(1) == pytest.approx(0.1, rel=0.1)


def test_a_pass_paced_by_flash_still_pays_a_share_of_its_compute():
    cost = model(streamed=2 * GB, head=0)  # io 2 s, far above any tree's compute
    cost.overlap = 0.25
    base = cost.step_seconds(1, [1], 1.0)
    bigger = cost.step_seconds(64, [1], 1.0)
    compute = cost.pass_compute_seconds(64) - cost.pass_compute_seconds(1)
    assert bigger - base == pytest.approx(0.25 * compute)
    resident = model(float("inf"), streamed=0, head=0)
    resident.overlap = 0.25  # nothing to overlap: the pass is its compute
    assert resident.step_seconds(64, [1], 1.0) == pytest.approx(
        resident.pass_compute_seconds(64) + resident.draft(1) + resident.project_seconds
    )


def test_passes_that_waited_on_flash_teach_the_share_of_compute_they_added():
    """Each pass read for 1.0 s and took 1.3 s, computing 0.9 s: 0.3 s of it past the reads."""
    cost = model()
    for _ in range(40):
        cost.observe(step(16, io_wait=0.4, verify=0.9, read=(GB, 1.0)))
    assert cost.overlap == pytest.approx(0.3 / 0.9, rel=1e-3)
    assert cost.contention == 0.2  # a pass that waited a third of its time taught no contention


def test_pruning_pays_only_where_it_can_save_more_than_its_probe():
    cost = model(float("inf"), streamed=0, head=0)  # resident: every pass compute-bound
    cost.verify = Curve([1, 2, 4, 64], [0.030, 0.031, 0.035, 0.4])
    cost.contention = 0.0
    share = 3 / 28  # the layers after the exit layer, of 28
    assert not cost.pruning_pays(4, share)  # at most 0.5 ms to save against 1 ms
    assert cost.pruning_pays(64, share)  # at most 39 ms
    for _ in range(60):  # probes of 50 ms: a slow pruner
        cost.observe(step(64, io_wait=0.0, verify=0.4, read=(0, 0.0), probe=0.05))
    assert cost.probe_seconds == pytest.approx(0.05, rel=1e-3)
    assert not cost.pruning_pays(64, share)


def test_a_point_raised_by_slower_passes_below_it_comes_back_to_its_profile():
    """One-row passes that ran slow for a while (another process busy) raised the two-row
    point with them; once they run at the profile again, the two-row point, read by no
    pass, goes back to its profile, where before it stayed raised and priced every copy
    (a second row) out for good (measured on the real pair: 23.9 -> 33.0 ms, kept)."""
    learned = Curve([1, 2, 4, 8], [0.020, 0.024, 0.030, 0.045])
    for _ in range(3):
        learned.learn(1, 0.035, 0.5)
    assert learned(2) > 0.03
    for _ in range(40):
        learned.learn(1, 0.020, 0.5)
    assert learned(1) == pytest.approx(0.020, rel=0.01)
    assert learned(2) == pytest.approx(0.024, rel=0.1)
    assert learned.seconds == sorted(learned.seconds)


def test_one_dear_pass_prices_its_size_out_for_a_while_only():
    learned = Curve([1, 2, 4, 8], [0.020, 0.024, 0.030, 0.045])
    learned.learn(2, 0.0425, 0.5)
    assert learned(2) > 0.03
    for _ in range(40):
        learned.learn(1, 0.020, 0.5)
    assert learned(2) == pytest.approx(0.024, rel=0.1)


def test_a_profile_measured_on_a_busy_machine_is_corrected_at_every_size():
    """A profile measured beside a compile priced every size at twice its time: passes of
    one and two rows at their true time bring the eight-row point, read by none, to within
    a fifth of its true time too, where it stayed dear and kept trees small."""
    true = [0.020, 0.024, 0.030, 0.045]
    learned = Curve([1, 2, 4, 8], [2 * t for t in true])
    for _ in range(40):
        learned.learn(1, true[0], 0.5)
        learned.learn(2, true[1], 0.5)
    assert learned(8) == pytest.approx(true[3], rel=0.2)


def test_a_profile_cached_before_curves_kept_one_reads_its_points_as_the_profile():
    """The cost model's profile is cached as msgpack: one written before the curve kept
    its profile reads back with its points as the profile."""
    old = msgspec.msgpack.encode({"sizes": [1, 2], "seconds": [0.02, 0.03]})
    read = msgspec.msgpack.decode(old, type=Curve)
    assert read.profiled == [0.02, 0.03]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(read), type=Curve) == read


def test_a_batchs_draft_round_costs_a_request_its_share_of_the_forward_all_run():
    """Eight requests drafting rounds of two nodes run one forward of 16 a round: a pass
    beside seven others prices each of its rounds at an eighth of the draft curve's 16
    (each request takes the round its own tokens pay for), not a forward of 2 shared eight
    ways, nor the whole forward of 16 against its own tokens."""
    cost = model(streamed=0, head=0)
    beside = Beside(requests=7, rows=7 * 3, tokens=7 * 2.0)
    drafting = (cost.draft(16) + cost.draft(8)) / 8
    seconds = drafting + cost.pass_compute_seconds(24) + 8 * 2.0 * 0.001
    assert cost.pass_rate(3, [2, 1], 2.0, beside) == pytest.approx(16.0 / seconds)
    alone = cost.draft(2) + cost.draft(1) + cost.pass_compute_seconds(3) + 2.0 * 0.001
    assert cost.pass_rate(3, [2, 1], 2.0) == pytest.approx(2.0 / alone)


def test_a_prompts_rows_are_the_passs_whatever_the_tree_so_nodes_are_priced_beside_them():
    """Compute-bound and linear in rows: a tree below a 100-token chain (a prefill) is
    priced as below one token, each node at what it adds; with the prompt's rows in the
    rate, any node would raise it."""
    cost = model(streamed=0, head=0)
    below_one = cost.pass_rate(1 + 5, [4], 3.0)
    assert cost.pass_rate(100 + 5, [4], 3.0, chain=100) == pytest.approx(below_one)
    assert cost.pass_rate(100 + 5, [4], 3.0) < below_one / 4  # the old price
