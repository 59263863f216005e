"""The scheduler decides alone, without trio or tensors: places in arrival order within
`parallel` and the KV room, a job of draft rounds once no other round is coming, a pass
once every seat not aside (waiting for its consumer) has sent its tree, and a joining
prompt's rows beside the requests decoding within about one of their steps."""

from __future__ import annotations

from lever_actors.policy.schedule import (
    LEAST_CHUNK_ROWS,
    Passes,
    Places,
    PrefillChunks,
    chunk_end,
)


def test_places_go_in_arrival_order_within_parallel():
    places = Places(parallel=2, room_tokens=1000)
    assert places.join(ticket=10, kv_tokens=100) == [(10, 0)]
    assert places.join(ticket=11, kv_tokens=100) == [(11, 1)]
    assert places.join(ticket=12, kv_tokens=100) == []  # two placed: it waits
    assert places.join(ticket=13, kv_tokens=100) == []
    assert places.leave(0) == [(12, 2)]  # the head of the line, not the one behind
    assert places.leave(1) == [(13, 3)]
    assert list(places.line) == []


def test_the_kv_room_holds_back_the_head_of_the_line_and_those_behind_it():
    places = Places(parallel=8, room_tokens=1000)
    assert places.join(1, 600) == [(1, 0)]
    assert places.join(2, 500) == []  # 1,100 would pass the room
    assert places.join(3, 100) == []  # it would fit, but it came later
    assert places.free_tokens == 400  # the prefix cache's
    assert places.leave(0) == [(2, 1), (3, 2)]
    assert places.free_tokens == 400


def test_a_request_takes_what_is_free_down_to_its_least_rather_than_wait():
    places = Places(parallel=8, room_tokens=1000)
    assert places.join(1, 600) == [(1, 0)]
    assert places.join(2, 500, least_tokens=350) == [(2, 1)]  # 400 free: it takes them
    assert places.placed == {0: 600, 1: 400}
    assert places.join(3, 100, least_tokens=10) == []  # none free
    assert places.leave(0) == [(3, 2)]
    assert places.placed == {1: 400, 2: 100}  # all it asked: it fits whole
    assert places.join(4, 600, least_tokens=550) == []  # 500 free, below its least
    assert places.free_tokens == 500


def test_a_request_alone_always_fits():
    places = Places(parallel=1, room_tokens=10)
    assert places.join(1, 10_000) == [(1, 0)]
    assert places.free_tokens == 0


def test_one_leaving_the_line_lets_in_those_behind_it():
    places = Places(parallel=4, room_tokens=1000)
    places.join(1, 600)
    assert places.join(2, 600) == []
    assert places.join(3, 300) == []
    assert places.withdraw(2) == [(3, 1)]
    assert places.placed == {0: 600, 1: 300}


def seated(*seats: int) -> Passes[str, str, str]:
    passes: Passes[str, str, str] = Passes()
    for seat in seats:
        passes.seat(seat, f"request {seat}")
    return passes


def test_draft_rounds_wait_for_every_seat_still_drafting():
    passes = seated(0, 1, 2)
    passes.add_tree(2, "tree 2")  # seat 2 has its tree: it drafts no more
    assert passes.add_round(0, "round 0")
    assert passes.rounds_ready() == []  # seat 1 still drafts
    assert passes.add_round(1, "round 1")
    assert passes.rounds_ready() == ["round 0", "round 1"]
    assert passes.rounds_ready() == []  # taken


def test_a_pass_waits_for_every_seats_tree_and_goes_in_seat_order():
    passes = seated(1, 0)
    passes.add_tree(1, "b")
    assert passes.pass_ready() == []
    passes.add_tree(0, "a")
    assert passes.pass_ready() == [(0, "request 0", "a"), (1, "request 1", "b")]
    assert passes.pass_ready() == []  # taken


def test_a_seat_that_leaves_takes_what_it_sent_and_no_longer_holds_up_the_rest():
    passes = seated(0, 1)
    passes.add_tree(0, "a")
    passes.add_round(1, "r")
    assert passes.unseat(1) == "request 1"
    assert passes.rounds_ready() == []  # its round went with it
    assert passes.pass_ready() == [(0, "request 0", "a")]
    assert not passes.add_round(1, "late")  # its request has gone
    assert passes.unseat(1) is None  # nobody sits there now


def test_a_request_gone_during_a_pass_is_not_waited_for_by_the_next():
    passes = seated(0, 1)
    passes.add_tree(0, "a")
    passes.add_tree(1, "b")
    assert len(passes.pass_ready()) == 2
    passes.unseat(1)  # its projector had ended: the verifier found it gone
    passes.add_tree(0, "a2")
    assert passes.pass_ready() == [(0, "request 0", "a2")]


def test_a_seat_aside_holds_up_no_pass_or_round_until_its_next_tree():
    passes = seated(0, 1, 2)
    passes.add_tree(0, "a")
    passes.add_round(1, "r")
    passes.step_aside(2)  # its request waits for its consumer
    assert passes.rounds_ready() == ["r"]
    passes.add_tree(1, "b")
    assert passes.pass_ready() == [(0, "request 0", "a"), (1, "request 1", "b")]
    passes.add_tree(2, "c")  # back: the next pass waits for it again
    passes.add_tree(0, "a2")
    assert passes.pass_ready() == []
    passes.add_tree(1, "b2")
    assert [seat for seat, _, _ in passes.pass_ready()] == [0, 1, 2]
    passes.step_aside(0)
    passes.unseat(0)
    assert passes.aside == set()  # gone with its request


MS = 1 / 1024  # about a millisecond: a binary fraction, so that the sums here are exact


def linear(rows: float) -> float:
    """A pass: 8 ms, and 1 ms a row."""
    return 8 * MS + rows * MS


def test_a_prompt_goes_whole_beside_nobody_decoding_or_requests_not_yet_stepping():
    chunks = PrefillChunks(linear)
    assert chunks.rows(decoding_rows=0, wanted=5000) is None
    assert chunk_end(0, size=5000, committed=4990, rows=None) == 5000
    # requests that came together: the first to decode has made no step alone yet
    assert chunks.rows(decoding_rows=1, wanted=5000) is None


def test_a_prompt_beside_decoding_requests_takes_rows_costing_about_their_step():
    chunks = PrefillChunks(linear)
    chunks.observe(64 * MS)
    assert chunks.rows(decoding_rows=20, wanted=5000) == 64
    chunks.observe(224 * MS)  # steps slowed: 30% of the way there
    assert chunks.rows(decoding_rows=20, wanted=5000) == 112
    assert chunks.rows(decoding_rows=20, wanted=30) == 30  # no more than wanted ...
    chunks.observe(0.0)
    assert chunks.rows(decoding_rows=1, wanted=3) == LEAST_CHUNK_ROWS  # ... but some


def test_what_a_prompts_rows_added_to_the_step_corrects_their_price():
    chunks = PrefillChunks(linear)
    chunks.observe(64 * MS)
    assert chunks.rows(decoding_rows=20, wanted=5000) == 64
    chunks.observe_chunk(128 * MS, decoding_rows=20, rows=32)  # twice their price: 30% there
    assert chunks.pace == 1.3
    assert chunks.rows(decoding_rows=20, wanted=5000) == 49


def test_a_batch_that_empties_forgets_its_step():
    unpriced = PrefillChunks(None)
    unpriced.observe(0.1)
    assert unpriced.rows(decoding_rows=4, wanted=5000) == LEAST_CHUNK_ROWS
    unpriced.forget()  # the batch emptied
    assert unpriced.rows(decoding_rows=4, wanted=5000) is None


def test_unpriced_rows_take_what_a_row_added_to_the_step_as_their_price():
    chunks = PrefillChunks(None)  # one token a pass: no cost model
    chunks.observe(270 * MS)
    assert chunks.rows(decoding_rows=3, wanted=5000) == LEAST_CHUNK_ROWS  # nothing seen yet
    chunks.observe_chunk(430 * MS, decoding_rows=3, rows=16)  # 10 ms a row
    assert chunks.rows(decoding_rows=3, wanted=5000) == 27  # about one step's worth
    assert chunks.rows(decoding_rows=3, wanted=20) == 20  # no more than wanted ...
    chunks.observe_chunk(1350 * MS, decoding_rows=3, rows=27)  # 40 ms a row: 30% there
    assert chunks.rows(decoding_rows=3, wanted=5000) == LEAST_CHUNK_ROWS  # ... but some
    chunks.observe_chunk(270 * MS, decoding_rows=3, rows=16)  # free beside a flash-paced step
    assert chunks.rows(decoding_rows=3, wanted=5000) == 20


def test_a_tree_goes_in_chunks_until_they_reach_its_last_committed_node():
    # a 100-token prompt and 8 drafts below it, 30 rows a pass
    assert chunk_end(0, size=108, committed=100, rows=30) == 30
    assert chunk_end(30, size=108, committed=100, rows=30) == 60
    assert chunk_end(60, size=108, committed=100, rows=30) == 90
    # the last committed node (99) and the drafts below it go together
    assert chunk_end(90, size=108, committed=100, rows=30) == 108
    assert chunk_end(60, size=108, committed=100, rows=39) == 108
    assert chunk_end(60, size=108, committed=100, rows=0) == 60  # none this pass


def test_prompts_that_came_together_go_shortest_first_each_pass_while_sharing_it_pays():
    # resident: a pass is 8 ms and 1 ms a row, so a 300-row prompt holds others 300 ms
    chunks = PrefillChunks(linear, pass_seconds=linear)
    assert chunks.together(0, 0, [300, 40, 350]) == [False, True, False]
    # beside the one decoding, the next shortest joins only where its rows cost the two in
    # the pass less than a pass of its own costs it and those after it (2 x 5 < 2 x 9 ms)
    assert chunks.together(1, 1, [4, 300, 5]) == [True, False, True]
    assert chunks.together(0, 0, [7]) == [True]


def test_where_a_pass_waits_on_its_reads_prompts_that_came_together_share_it():
    def streamed(rows: float) -> float:  # 400 ms of reads under which 200 rows compute
        return max(400 * MS, 2 * rows * MS) + 0.2 * min(400 * MS, 2 * rows * MS)

    chunks = PrefillChunks(linear, pass_seconds=streamed)
    assert chunks.together(0, 0, [120, 30, 60]) == [True, True, True]
    # without a price they go together as before
    assert PrefillChunks(linear).together(2, 2, [300, 40]) == [True, True]
