"""Several requests at once (EngineConfig.parallel): each request's tokens are its own
sequential decoding, greedy or sampled with its seed, whatever runs beside it: arrival
times, the other requests' lengths, prompts and sampling, cancellations, the batch's size
and how many rows of a joining prompt each pass takes. Float64 tiny models
(lever_actors.testing); example counts scale with the hypothesis profile
(tests/conftest.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial
from unittest import mock

import msgspec
import pytest
import trio
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

import lever_actors.actors.drafter as drafter_module
import lever_actors.actors.verifier as verifier_module
import lever_actors.engine.crew as crew_module
import lever_actors.engine.engine as engine_module
from lever_actors.config import EngineConfig
from lever_actors.engine import Engine
from lever_actors.engine.batch import Batch
from lever_actors.model.sampling import GREEDY, Sampling
from lever_actors.options import GenerationOptions
from lever_actors.policy.schedule import PrefillChunks
from lever_actors.policy.trees import Round
from lever_actors.testing import (
    bf16_engine_cases,
    engine_cases,
    prompts,
    reference_tokens,
    repetitive_prompts,
    samplings,
    trees,
)
from lever_actors.testing.checkpoints import TINY_ARGS, model_pair
from lever_actors.testing.strategies import BF16_MAX_SEQUENCE, BF16_PROMPT

TIMEOUT = 120


@dataclass(frozen=True)
class Arrival:
    """One request of a schedule: when it comes, what it asks, when its consumer leaves."""

    delay: float  # seconds after the schedule starts
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    leave_after: int | None  # tokens taken before the consumer stops listening; None: all


@st.composite
def schedules(
    draw: st.DrawFn,
    vocab: int,
    prompt_lists: Callable[[int], st.SearchStrategy[list[int]]] = prompts,
    most_new: int = 16,
) -> list[Arrival]:
    """Two to five requests arriving at random times, some of them cancelled midway."""
    return draw(
        st.lists(
            st.builds(
                Arrival,
                delay=st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.2]),
                prompt=prompt_lists(vocab),
                max_new_tokens=st.integers(1, most_new),
                sampling=st.one_of(st.just(GREEDY), samplings()),
                leave_after=st.one_of(st.none(), st.none(), st.integers(1, 8)),
            ),
            min_size=2,
            max_size=5,
        )
    )


def prompts_in_chunks(rows: int | None) -> contextlib.AbstractContextManager:
    """A joining prompt `rows` rows a pass beside requests decoding (None: as priced)."""
    if rows is None:
        return contextlib.nullcontext()
    return mock.patch.object(
        PrefillChunks, "rows", lambda self, decoding, wanted: rows if decoding else None
    )


CHUNK_ROWS = st.sampled_from([None, 1, 3])


def options(arrival: Arrival) -> GenerationOptions:
    return GenerationOptions(max_new_tokens=arrival.max_new_tokens, sampling=arrival.sampling)


async def run_schedule(engine: Engine, schedule: list[Arrival]) -> dict[int, list]:
    """Every request of the schedule at its time; each one's events as its consumer saw them."""
    seen: dict[int, list] = {}

    async def one(index: int, arrival: Arrival) -> None:
        await trio.sleep(arrival.delay)
        events = seen[index] = []
        stream = engine.stream(arrival.prompt, options=options(arrival))
        async with aclosing(stream) as tokens:
            async for token in tokens:
                events.append(token)
                if len(events) == arrival.leave_after:
                    break  # leaving the loop cancels the request

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            for index, arrival in enumerate(schedule):
                nursery.start_soon(one, index, arrival)
    return seen


def assert_each_sequential(target, schedule: list[Arrival], seen: dict[int, list]) -> None:
    for index, arrival in enumerate(schedule):
        expected = reference_tokens(
            target, arrival.prompt, arrival.max_new_tokens, sampling=arrival.sampling
        )
        got = [e.token for e in seen[index]]
        if arrival.leave_after is None:
            assert got == expected, f"request {index}: {arrival}"
        else:  # cancelled: what it took is the sequential decoding's beginning
            assert got == expected[: len(got)], f"request {index}: {arrival}"


@settings(max_examples=max(1, round(settings.default.max_examples * 0.5)))
@given(
    case=engine_cases(tree_shapes=trees(kinds=("none", "chain", "static", "gaincost", "lookup"))),
    parallel=st.integers(1, 4),
    chunk=CHUNK_ROWS,
    data=st.data(),
)
async def test_each_request_equals_its_sequential_decoding_whatever_runs_beside_it(
    case, parallel, chunk, data
):
    schedule = data.draw(schedules(case.args.vocab_size), label="schedule")
    config = msgspec.structs.replace(case.engine_config(), parallel=parallel)
    with prompts_in_chunks(chunk):
        async with Engine.open(config) as engine:
            seen = await run_schedule(engine, schedule)
    most = max((e.parallel for events in seen.values() for e in events), default=1)
    note(f"most requests in one pass: {most}")
    event(f"most requests in one pass: {min(most, parallel)}")
    assert most <= parallel
    assert_each_sequential(config.target, schedule, seen)


@settings(max_examples=max(1, settings.default.max_examples // 15))  # ci: 4
@given(case=bf16_engine_cases(), parallel=st.integers(2, 4), chunk=CHUNK_ROWS, data=st.data())
async def test_in_bf16_and_quantized_each_request_equals_its_sequential_decoding(
    case, parallel, chunk, data
):
    """bf16 targets with near-tied twin tokens, dense or quantized, whose trees mostly pass
    32 rows, so that a pass of several trees runs the products where a kernel that is not
    batch-invariant would round a row differently beside other requests' rows."""
    bf16_prompts = partial(repetitive_prompts, min_size=2, max_size=BF16_PROMPT)
    schedule = data.draw(
        schedules(case.args.vocab_size, bf16_prompts, BF16_MAX_SEQUENCE - BF16_PROMPT),
        label="schedule",
    )
    config = msgspec.structs.replace(case.engine_config(), parallel=parallel)
    with prompts_in_chunks(chunk):
        async with Engine.open(config) as engine:
            seen = await run_schedule(engine, schedule)
    most = max((e.parallel for events in seen.values() for e in events), default=1)
    event(f"most requests in one pass: {most}")
    assert_each_sequential(config.target, schedule, seen)


async def test_requests_that_arrive_together_share_passes_and_stay_exact():
    """Three requests of different lengths and samplings at once: their trees go through
    the same passes (StepStats.parallel), and each emits its own sequential tokens;
    a fourth waits for a place and then runs exactly too."""
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(
        target=str(pair.target), draft=str(pair.draft), tree="gaincost", parallel=3
    )
    schedule = [
        Arrival(0.0, [5, 6, 7, 8], 24, GREEDY, None),
        Arrival(0.0, [1, 2, 3], 12, Sampling(temperature=0.8, seed=7), None),
        Arrival(0.0, [9, 10, 11, 12, 13, 14], 18, GREEDY, None),
        Arrival(0.0, [4, 4, 4], 10, Sampling(temperature=1.2, top_k=5, seed=1), None),
    ]
    async with Engine.open(config) as engine:
        results: dict[int, object] = {}

        async def generate(index: int, arrival: Arrival) -> None:
            results[index] = await engine.generate(arrival.prompt, options=options(arrival))

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                for index, arrival in enumerate(schedule):
                    nursery.start_soon(generate, index, arrival)
                    await trio.sleep(0)  # in this order
        assert engine.batch.active == engine.batch.queued == 0
    passes = [max(s.parallel for s in results[i].steps) for i in range(4)]
    assert max(passes) == 3  # the three shared passes
    for index, arrival in enumerate(schedule):
        expected = reference_tokens(
            config.target, arrival.prompt, arrival.max_new_tokens, sampling=arrival.sampling
        )
        assert results[index].tokens == expected, index


async def test_trees_are_sized_beside_the_others_trees_not_their_prompts(monkeypatch):
    """Two 40-token prompts at once under trees of at most 8 nodes: after the first step,
    each tree is priced beside the other's tree as its next pass will have it (at most 9
    rows), not beside the other's prompt; both texts are their sequential decodings."""
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(
        target=str(pair.target), draft=str(pair.draft), tree="gaincost:8", parallel=2
    )
    prompts = [[(3 * i) % 29 + 1 for i in range(40)], [(5 * i) % 31 + 1 for i in range(40)]]
    besides: list = []
    beside = Batch.beside

    def recorded(self, place):
        besides.append(beside(self, place))
        return besides[-1]

    monkeypatch.setattr(Batch, "beside", recorded)
    results: dict[int, object] = {}
    with trio.fail_after(TIMEOUT):
        async with Engine.open(config) as engine:

            async def run(index: int) -> None:
                results[index] = await engine.generate(prompts[index], max_new_tokens=12)

            async with trio.open_nursery() as nursery:
                for index in range(2):
                    nursery.start_soon(run, index)
    together = [b for b in besides if b.requests == 1 and b.rows]
    assert together and max(b.rows for b in together) <= 9, together
    for index, prompt in enumerate(prompts):
        assert results[index].tokens == reference_tokens(config.target, prompt, 12), index


@pytest.mark.parametrize("tree", ["gaincost", "lookup"])
async def test_a_prompt_joining_a_decoding_batch_comes_in_chunks_and_stalls_nobody(
    tree, monkeypatch
):
    """A 40-token prompt joins a request already decoding, 4 rows a pass: its first token
    comes after ten passes, each of which gave the running request its next tokens; the
    draft, where there is one, catches up with the prompt 4 tokens a round meanwhile; both
    texts are their sequential decodings."""
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(target=str(pair.target), draft=str(pair.draft), tree=tree, parallel=2)
    running, joining = [5, 6, 7, 8], [(3 * i) % 29 + 1 for i in range(40)]
    monkeypatch.setattr(drafter_module, "rows_within", lambda seconds, cost, wanted: 4)
    first_forwards: list[int] = []  # the rows of each draft forward that runs committed text
    placed = Round.placed

    def recorded(self):
        tokens, place = placed(self)
        if self.nodes is None:
            first_forwards.append(len(tokens))
        return tokens, place

    monkeypatch.setattr(Round, "placed", recorded)
    seen: list = []
    decoding = trio.Event()
    with prompts_in_chunks(4), trio.fail_after(TIMEOUT):
        async with Engine.open(config) as engine:

            async def run() -> None:
                async for event in engine.stream(running, max_new_tokens=60):
                    seen.append(event)
                    decoding.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                await decoding.wait()
                joined = await engine.generate(joining, max_new_tokens=8)
    first = joined.steps[0]
    assert first.passes == 10  # 40 rows, 4 a pass (the last with the drafts below)
    # a pass of the prompt was a step of the running request too
    assert len({e.step for e in seen if e.parallel == 2}) >= first.passes
    if tree == "gaincost":  # one token first, the prompt into the draft a chunk a round
        assert first.tree_nodes == 40 and first.draft_rounds == ()
        assert first_forwards and max(first_forwards) <= 5
    assert [e.token for e in seen] == reference_tokens(config.target, running, 60)
    assert joined.tokens == reference_tokens(config.target, joining, 8)


async def test_prompts_that_come_together_start_shortest_first_a_pass_each(monkeypatch):
    """Priced at 8 ms a pass and 1 ms a row, a 4-token prompt and prompts of 60 and 61 that
    come with it go through the layers a pass each, shortest first: the first token of each
    comes from a pass beside those before it (not from one pass of all three); all three
    texts are their sequential decodings."""
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(target=str(pair.target), tree="lookup", parallel=3)
    prompts = {
        "short": [5, 6, 7, 8],
        "long": [(3 * i) % 29 + 1 for i in range(60)],
        "longer": [(5 * i) % 31 + 1 for i in range(61)],
    }
    monkeypatch.setattr(crew_module, "_pass_seconds", lambda p: lambda rows: (8 + rows) / 1024)
    results: dict[str, list] = {}
    with trio.fail_after(TIMEOUT):
        async with Engine.open(config) as engine:

            async def run(name: str) -> None:
                stream = engine.stream(prompts[name], max_new_tokens=30)
                results[name] = [event async for event in stream]

            async with trio.open_nursery() as nursery:
                for name in prompts:
                    nursery.start_soon(run, name)
                    await trio.sleep(0)  # in this order
    assert [results[name][0].parallel for name in prompts] == [1, 2, 3]
    for name, prompt in prompts.items():
        tokens = [e.token for e in results[name]]
        assert tokens == reference_tokens(config.target, prompt, 30), name


async def test_trees_copy_the_text_while_the_pass_has_as_many_requests_as_the_plan_says():
    """With `copies_from` 2 (the plan's price), each request's steps copy the text while
    both decode, with the draft kept; the longer one's draft then catches up and drafts
    again alone; both texts are their sequential decodings."""
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(
        target=str(pair.target), draft=str(pair.draft), tree="gaincost", parallel=2
    )
    results: dict[str, object] = {}
    with trio.fail_after(TIMEOUT):
        async with Engine.open(config) as engine:
            engine.switch.copies_from = 2

            async def run(name: str, prompt: list[int], tokens: int) -> None:
                results[name] = await engine.generate(prompt, max_new_tokens=tokens)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "long", [5, 6, 7, 8], 40)
                nursery.start_soon(run, "short", [1, 2, 3], 6)
    long_ = results["long"]
    together = [s for s in long_.steps[1:] if s.parallel == 2]
    assert together and all(s.draft_rounds == () for s in together)  # copies, no draft
    assert any(s.draft_rounds for s in long_.steps if s.parallel == 1)  # trees again
    assert long_.tokens == reference_tokens(config.target, [5, 6, 7, 8], 40)
    assert results["short"].tokens == reference_tokens(config.target, [1, 2, 3], 6)


async def test_a_failing_draft_forward_fails_its_own_request_and_no_other(monkeypatch):
    """Draft forwards of several requests run as one job; where it fails, each runs again
    alone, so that only the request whose forward fails raises, and the others stay exact."""
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(
        target=str(pair.target), draft=str(pair.draft), tree="static:2,2", parallel=2
    )
    doomed = [7, 7, 7, 7]  # its first tree's chain, four long, marks its draft cache
    seen = {"cache": None, "rounds": 0}
    placed = Round.placed

    def failing(self):
        b = self.builder
        if self.nodes is not None:
            if b.tokens[: b.n_chain] == doomed:
                seen["cache"] = b.cache
            if b.cache is seen["cache"]:
                seen["rounds"] += 1
                if seen["rounds"] > 2:  # its second tree's: both requests draft in step then
                    raise Broken("this request's draft forward broke")
        return placed(self)

    monkeypatch.setattr(Round, "placed", failing)
    failed_jobs: list[int] = []  # rounds in each draft job that failed
    run_rounds = verifier_module.run_rounds

    def counted(rounds):
        try:
            run_rounds(rounds)
        except Broken:
            failed_jobs.append(len(rounds))
            raise

    monkeypatch.setattr(verifier_module, "run_rounds", counted)
    async with Engine.open(config) as engine:
        outcome: dict[str, object] = {}

        async def run(name: str, prompt: list[int]) -> None:
            try:
                outcome[name] = await engine.generate(prompt, max_new_tokens=24)
            except Broken as error:
                outcome[name] = error

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "doomed", doomed)
                nursery.start_soon(run, "other", [1, 2, 3])
    assert isinstance(outcome["doomed"], Broken)
    other = outcome["other"]
    assert other.tokens == reference_tokens(config.target, [1, 2, 3], 24)
    assert failed_jobs[:2] == [2, 1]  # the job of both, then the doomed one's alone


class Broken(Exception):
    pass


async def test_a_request_the_room_has_no_whole_tree_for_starts_beside_with_a_smaller_one(
    monkeypatch,
):
    """A room of 134 tokens holds the first request's 92 (4 + 24 new + a 62-node tree + 2),
    and 42 of the second's 79: it starts beside the first with trees of 25 nodes (42 less
    its 3 + 12 + 2) where it would have waited for a whole one's; both texts are their
    sequential decodings."""
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(
        target=str(pair.target), draft=str(pair.draft), tree="static:2,2,2,2,2", parallel=2
    )
    monkeypatch.setattr(engine_module, "Batch", lambda parallel, room: Batch(parallel, 134))
    trees: list[int] = []  # the draft nodes of each tree sent
    draft = drafter_module.Drafter.draft

    async def recorded(self, request):
        tree = await draft(self, request)
        trees.append(len(tree.tokens) - tree.n_committed)
        return tree

    monkeypatch.setattr(drafter_module.Drafter, "draft", recorded)
    asked = {"a": [5, 6, 7, 8], "b": [1, 2, 3]}
    new = {"a": 24, "b": 12}
    results: dict[str, object] = {}
    with trio.fail_after(TIMEOUT):
        async with Engine.open(config) as engine:

            async def run(name: str) -> None:
                results[name] = await engine.generate(asked[name], max_new_tokens=new[name])

            async with trio.open_nursery() as nursery:
                for name in asked:
                    nursery.start_soon(run, name)
                    await trio.sleep(0)  # in this order
    assert set(trees) == {25, 62}
    assert max(s.parallel for s in results["b"].steps) == 2  # beside the first
    for name, prompt in asked.items():
        assert results[name].tokens == reference_tokens(config.target, prompt, new[name])
