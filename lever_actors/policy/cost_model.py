"""What a decoding step costs: profiled once at engine start, then corrected online.

All times are seconds. The verifier's compute and one draft forward are measured curves
over the number of nodes; flash time is the streamed bytes over the measured bandwidth.
"""

from __future__ import annotations

import bisect
import math

import msgspec

from lever_actors.channels.messages import ALONE, Beside, StepStats

ONLINE_WEIGHT = 0.2  # exponential moving average: recent steps count, one outlier does not
# the verify curve learns a segment at a time, from the passes read from it, so it may move
# faster: a request at 1 GiB runs 8-16 steps, whose passes computed 1.3-2x the profile
VERIFY_WEIGHT = 0.5
IO_BOUND_WAIT = 0.25  # a pass that spent this share of its time waiting for layers is I/O-bound


# each learned pass moves the points it was not read from this share of the way back to the
# profile at the machine's pace: a point only ever raised (by a slower pass below it, or one
# dear pass) comes back within some 20 passes to be tried again, where it would stay priced
# out for good
RELAX = 0.05


class Curve(msgspec.Struct):
    """Seconds as a function of a size, piecewise linear between measured points."""

    sizes: list[int]
    seconds: list[float]
    profiled: list[float] = msgspec.field(default_factory=list)  # as measured at start
    # the passes' time against the profile's, learned from every pass: a profile measured
    # while the machine was busy (or quieter) is wrong by a factor at every size
    pace: float = 1.0

    def __post_init__(self) -> None:
        if not self.profiled:
            self.profiled = list(self.seconds)

    def __call__(self, size: float) -> float:
        return _interpolated(self.sizes, self.seconds, size)

    def scale(self, factor: float) -> None:
        self.seconds = [s * factor for s in self.seconds]
        self.pace *= factor

    def learn(self, size: float, measured: float, weight: float) -> None:
        """Move the prediction at `size` the `weight` share of the way to `measured`, by
        scaling only the segment it is read from (the first point alone below it), so the
        shape follows the sizes in use; the other points go RELAX of the way back to the
        profile at the passes' pace. The curve stays non-decreasing: the points above the
        segment are at least its last, those below at most its first."""
        predicted, profiled = self(size), _interpolated(self.sizes, self.profiled, size)
        if predicted <= 0 or measured <= 0:
            return
        if profiled > 0:
            self.pace += ONLINE_WEIGHT * (measured / profiled - self.pace)
        factor = 1 + weight * (measured / predicted - 1)
        sizes, seconds = self.sizes, self.seconds
        i = min(bisect.bisect_left(sizes, size), len(sizes) - 1)
        segment = [0] if size <= sizes[0] else [i - 1, i]
        for j in range(len(seconds)):
            if j in segment:
                seconds[j] *= factor
            else:
                seconds[j] += RELAX * (self.pace * self.profiled[j] - seconds[j])
        for j in range(segment[-1] + 1, len(seconds)):
            seconds[j] = max(seconds[j], seconds[j - 1])
        for j in range(segment[0] - 1, -1, -1):
            seconds[j] = min(seconds[j], seconds[j + 1])


def _interpolated(sizes: list[int], values: list[float], size: float) -> float:
    if size <= sizes[0]:
        return values[0] * max(size, 0) / sizes[0] if sizes[0] else values[0]
    i = bisect.bisect_left(sizes, size)
    if i == len(sizes):  # beyond the last point: extend the last segment's slope
        i -= 1
    lo, hi = sizes[i - 1], sizes[i]
    slope = (values[i] - values[i - 1]) / (hi - lo)
    return values[i - 1] + slope * (size - lo)


class CostModel(msgspec.Struct):
    """The engine's beliefs about step costs; exposed in statistics."""

    flash_bandwidth: float  # bytes/s while streaming
    streamed_bytes: int  # read from flash per step (one pass over the streamed layers)
    verify: Curve  # target compute of one full pass, by tree nodes
    draft: Curve  # one draft-model forward, by nodes in the batch
    project_seconds: float  # final norm + LM head products for one node, beyond the read
    # a pass over the resident head: its weights read from DRAM once, whatever its rows
    # (7.3 ms of one row's 11 on the real pair, 2-core EPYC); 0 where the head streams
    head_pass_seconds: float
    head_bytes: int = 0  # a head streamed from flash: read once per step
    overhead_seconds: float = 0.0  # per step, beyond the parts above (learned online)
    # Verification overlaps its flash reads: a pass takes max(io, verify * (1 + contention)),
    # where io is the streamed bytes over the bandwidth the reads themselves achieve, and
    # contention is learned from passes that hardly waited (waits for the first layers,
    # and compute slowed by the reads beside it).
    contention: float = 0.2
    # ... and the overlap is not whole: an I/O-bound pass took its reads' time plus this
    # share of its compute (a layer's compute after its read, the checks and the compute
    # slowing the reads: 0.18 of 250 ms beside 305 ms of reads, 1.0 GiB, Zen 4), so a node
    # costs time where flash paces the pass too; learned from such passes
    overlap: float = 0.2
    # the pruner's round trip at the exit layer: its job and two handoffs between threads
    # (0.65-1 ms of job and about 0.4 of handoffs on a resident step, Zen 4); learned from
    # the passes that probe
    probe_seconds: float = 0.001

    @property
    def io_seconds(self) -> float:
        return self.streamed_bytes / self.flash_bandwidth if self.streamed_bytes else 0.0

    @property
    def head_read_seconds(self) -> float:
        return self.head_bytes / self.flash_bandwidth if self.head_bytes else 0.0

    def pass_compute_seconds(self, nodes: float) -> float:
        """Verification compute of a pass over `nodes`, slowed by the reads beside it (none
        where nothing is read: everything resident, a one-token step priced 85.6 ms against
        65 run, 2-core EPYC)."""
        reads = self.streamed_bytes or self.head_bytes
        return self.verify(nodes) * (1 + self.contention if reads else 1)

    def io_bound(self, nodes: int) -> bool:
        """Whether a pass over `nodes` waits on flash rather than on compute."""
        return self.pass_compute_seconds(nodes) <= self.io_seconds

    def pruning_pays(self, nodes: int, share_after_exit: float) -> bool:
        """Whether probing a pass over `nodes` can pay: the most pruning could save (every
        node but one dropped for the layers after the exit layer, `share_after_exit` of
        them) must exceed the probe's own cost. A resident 4-node pass could save 0.8 ms
        against a 1 ms probe."""
        most = (self.pass_compute_seconds(nodes) - self.pass_compute_seconds(1)) * share_after_exit
        return most > self.probe_seconds

    def step_seconds(self, nodes: float, draft_rounds: list[int], expected_tokens: float) -> float:
        """Predicted step time: drafting, then verification overlapped with its flash reads,
        then projection along the expected accepted path in one pass over the head (or, with
        a streamed head, of every node in its one read)."""
        drafting = sum(self.draft(width) for width in draft_rounds)
        compute, io = self.pass_compute_seconds(nodes), self.io_seconds
        verifying = max(io, compute) + self.overlap * min(io, compute)
        projecting = (
            self.head_read_seconds
            + self.head_pass_seconds
            + self.project_seconds * (nodes if self.head_bytes else expected_tokens)
        )
        return drafting + verifying + projecting + self.overhead_seconds

    def pass_rate(
        self,
        nodes: int,
        draft_rounds: list[int],
        expected_tokens: float,
        beside: Beside = ALONE,
        chain: int = 1,
    ) -> float:
        """Predicted tokens per second of a pass: a tree of `nodes` that gives
        `expected_tokens`, verified with the rows of the requests `beside` it, whose tokens
        count too (a node slows every request in the pass). Their draft rounds run with
        ours, a forward for all, each as wide as ours is taken to be: a batch's round costs
        what its rows together do (8 requests' rounds of 2 nodes: a forward of 16), and our
        share of it is ours of its rows, as every request takes the round its tokens pay
        for. Charged the whole forward, no request's round paid beside three others' tokens:
        their trees stopped at 1-1.5 rounds (alone 3-6), 5 nodes each (1 GiB, Zen 4).

        `chain`: the committed tokens among `nodes`. Beyond the first (a prompt's) their
        rows come whatever the tree: the step is priced as one of a one-token chain, each
        node at what it adds beside them. Priced with them, a prefill's rate was so low that
        any node raised it (a 128-token prompt's first tree grew 31 nodes, 0.9 s of rows)."""
        sharers = 1 + beside.requests
        drafting = sum(self.draft(width * sharers) for width in draft_rounds) / sharers
        tokens = expected_tokens + beside.tokens  # each request projects its own path
        seconds = self.step_seconds(nodes + beside.rows, [], tokens) + drafting
        if chain > 1:
            prompt = self.step_seconds(chain + beside.rows, [], 1.0)
            seconds -= prompt - self.step_seconds(1 + beside.rows, [], 1.0)
        return tokens / seconds

    def observe(self, step: StepStats) -> None:
        """Correct the beliefs with one finished step: its drafting and compute times, its
        flash reads, how long the pass waited for layers, and its whole time. The reads
        teach the bandwidth: their own time, not the pass's, which a big tree's compute
        stretches (taught as bandwidth, that stretch let trees grow, stretching it further).
        A pass that hardly waited was compute-bound: its waits, per second of compute,
        teach `contention`; one that waited longer took its reads' time plus a share of its
        compute, which teaches `overlap`. A step whose prompt came in chunks beside other
        requests' passes teaches nothing: its time is theirs too."""
        if step.passes > 1:
            return
        rounds = list(step.draft_rounds)
        rows = step.pass_rows or step.tree_nodes  # the pass's compute: all its requests' nodes
        self.verify.learn(rows, step.verify_seconds, VERIFY_WEIGHT)
        _correct(self.draft, sum(self.draft(w) for w in rounds), step.draft_seconds)
        if step.read_seconds > 0 and (self.streamed_bytes or self.head_bytes):
            seen = step.bytes_read / step.read_seconds
            if math.isinf(self.flash_bandwidth):  # no layer streamed at start-up to measure
                self.flash_bandwidth = seen
            else:
                self.flash_bandwidth += ONLINE_WEIGHT * (seen - self.flash_bandwidth)
        passed = step.io_wait_seconds + step.verify_seconds
        if step.verify_seconds > 0:
            if step.io_wait_seconds <= IO_BOUND_WAIT * passed:
                seen = step.io_wait_seconds / step.verify_seconds
                self.contention += ONLINE_WEIGHT * (seen - self.contention)
            elif 0 < step.read_seconds < passed:
                seen = (passed - step.read_seconds) / step.verify_seconds
                self.overlap += ONLINE_WEIGHT * (min(seen, 1.0) - self.overlap)
        if step.probe_seconds > 0:
            self.probe_seconds += ONLINE_WEIGHT * (step.probe_seconds - self.probe_seconds)
        predicted = self.step_seconds(rows, rounds, step.new_tokens)
        unexplained = step.step_seconds - (predicted - self.overhead_seconds)
        self.overhead_seconds += ONLINE_WEIGHT * (max(unexplained, 0.0) - self.overhead_seconds)


def _correct(curve: Curve, predicted: float, measured: float) -> None:
    """Scale a curve toward what was measured, a step of ONLINE_WEIGHT at a time."""
    if predicted > 0 and measured > 0:
        curve.scale(1 + ONLINE_WEIGHT * (measured / predicted - 1))
