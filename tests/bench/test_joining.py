"""A prompt joining requests already decoding (bench/joining.py): when it comes, and its
figures from the stamps of a run, without a model."""

from __future__ import annotations

import pytest
import trio

from lever_actors.bench.joining import (
    JOIN_AFTER_TOKENS,
    join_delay,
    joining_figures,
    run_joining,
    step_times,
)
from lever_actors.bench.mode import Decoded
from lever_actors.bench.together import Together
from lever_actors.model.sampling import Sampling


def test_a_steps_tokens_count_once():
    assert step_times([1.0, 1.00001, 1.2, 1.2, 1.5]) == [1.0, 1.2, 1.5]
    # where the engine names each token's step, its tokens count once however far apart
    assert step_times([1.0, 1.001, 1.2, 1.202, 1.5], [3, 3, 4, 4, 5]) == [1.0, 1.2, 1.5]


def test_it_comes_once_the_running_requests_are_some_tokens_into_their_answers():
    slow = Decoded(list(range(40)), [10.0 + 0.1 * i for i in range(40)])
    fast = Decoded(list(range(40)), [10.0 + 0.05 * i for i in range(40)])
    short = Decoded([1, 2], [10.5, 10.6])  # it ended first: its end counts
    round_ = Together([slow, fast, short], started=[9.0, 9.0, 9.0], ended=[14, 12, 10.7])
    assert join_delay(round_, 2) == pytest.approx(1.0 + 0.1 * (JOIN_AFTER_TOKENS - 1))
    assert join_delay(round_, 3) == pytest.approx(1.0 + 0.1 * (JOIN_AFTER_TOKENS - 1))
    assert join_delay(Together([short], [9.0], [10.7]), 1) == pytest.approx(1.7)


def test_its_figures_are_its_first_tokens_time_and_the_others_gaps_meanwhile():
    # the running request: a step every 0.1 s (two tokens each) until it came at 2.02,
    # then one of 0.4 s and 0.1 s again; the joining one's first token at 2.55
    steps = [1.0 + 0.1 * i for i in range(11)] + [2.4, 2.5, 2.6, 2.7]
    stamps = [t + d for t in steps for d in (0.0, 0.00001)]
    running = Decoded(list(range(len(stamps))), stamps)
    joined = Decoded([7], [2.55])
    busy = Together([running, joined], started=[0.5, 2.02], ended=[2.7, 2.6])
    j = joining_figures("prose", 3, 420, alone_s=0.25, busy=busy)
    assert (j.prompt_set, j.prompt_index, j.prompt_tokens, j.running) == ("prose", 3, 420, 1)
    assert j.first_token_alone_s == 0.25
    assert j.first_token_busy_s == pytest.approx(0.53)
    assert j.step_s == pytest.approx(0.1)  # their median before it
    assert j.gap_s == pytest.approx(0.4)  # 2.0 to 2.4: the step it came in


def test_with_none_of_them_decoding_when_it_came_their_gap_is_not_measured():
    running = Decoded(list(range(5)), [1.0, 1.1, 1.2, 1.3, 1.4])  # done before it came
    joined = Decoded([7], [2.55])
    busy = Together([running, joined], started=[0.5, 2.0], ended=[1.4, 2.6])
    j = joining_figures("code", 0, 300, alone_s=0.5, busy=busy)
    assert j.step_s == pytest.approx(0.1)
    assert j.gap_s is None


def test_the_running_prompts_prefill_again_as_in_the_round_that_timed_the_join():
    class Recording:
        def __init__(self):
            self.calls = []

        async def decode_together(self, prompts, max_new_tokens, stop_ids, sampling, delays=()):
            self.calls.append((prompts, list(delays)))
            return Together(
                [Decoded([1], [1.0]) for _ in prompts], [0.0] * len(prompts), [1.0] * len(prompts)
            )

    mode = Recording()
    first = Decoded(list(range(20)), [10.0 + 0.1 * i for i in range(20)])
    first_round = Together([first, first], started=[9.0, 9.0], ended=[12.0, 12.0])
    trio.run(run_joining, mode, [[5, 6, 7]], first_round, [1, 2, 3, 4], 8, frozenset(), Sampling())
    (alone, _), (busy, delays) = mode.calls
    assert alone == [[2, 3, 4]]
    assert busy == [[6, 7], [3, 4]]  # none begins as an earlier text did
    assert delays == [0.0, pytest.approx(1.0 + 0.1 * (JOIN_AFTER_TOKENS - 1))]
