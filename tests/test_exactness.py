"""The exactness contract, as properties: whatever the models, the draft, the tree, the DRAM
budget, the channel capacities and the actors' scheduling, the engine emits exactly the
target's sequential greedy tokens, or with a seed its sequentially sampled ones (float64
tiny models; lever_actors.testing draws them).

Example counts scale with the hypothesis profile (see tests/conftest.py).
"""

from __future__ import annotations

import msgspec
import trio
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from lever_actors.config import EngineConfig, TreeSpec
from lever_actors.device.budget import minimum_budget
from lever_actors.device.manifest import read_manifest
from lever_actors.engine import Engine
from lever_actors.model.sampling import GREEDY, Sampling
from lever_actors.policy import setup as policy_setup
from lever_actors.testing import (
    BYTE_VOCAB,
    assert_matches_sequential,
    early_exits,
    engine_cases,
    grammars,
    jitters,
    model_args,
    prompts,
    reference_tokens,
    samplings,
    trees,
)
from lever_actors.testing.checkpoints import TINY_ARGS, model_pair
from tests.calibrators import learned


def examples(share: float) -> settings:
    """This test's share of the profile's examples."""
    return settings(max_examples=max(1, round(settings.default.max_examples * share)))


def tally(case, result) -> None:
    """What the example exercised, for --hypothesis-show-statistics."""
    event(f"tree {case.tree.split(':')[0]}, early exit {case.early_exit}")
    event(f"draft tokens accepted: {any(s.new_tokens > 1 for s in result.steps)}")
    event(f"nodes pruned: {any(s.pruned for s in result.steps)}")
    event(f"tokens copied from the text: {any(s.copied for s in result.steps)}")


@examples(1.5)
@given(case=engine_cases())
async def test_engine_equals_sequential_reference(case):
    result = await assert_matches_sequential(case.engine_config(), case.prompt, case.max_new_tokens)
    tally(case, result)


drafting = trees(kinds=("chain", "static", "gaincost"))


@examples(1.0)
@given(
    case=engine_cases(
        tree_shapes=drafting,
        predictors=early_exits(("lens", "trained", "probe_only")),
        jitter=jitters(always=True),
    )
)
async def test_speculation_under_scheduling_jitter_equals_sequential_reference(case):
    """Random actor pauses reorder every message exchange, pruning probes included."""
    result = await assert_matches_sequential(case.engine_config(), case.prompt, case.max_new_tokens)
    tally(case, result)


@examples(0.7)
@given(case=engine_cases(tree_shapes=drafting, sampling=samplings(), jitter=jitters()))
async def test_seeded_sampling_equals_sequential_sampling(case):
    """Sampled tokens are a function of (seed, position) and the target's logits alone, so
    the engine emits exactly what one-token sampling with the same seed emits."""
    result = await assert_matches_sequential(
        case.engine_config(), case.prompt, case.max_new_tokens, sampling=case.sampling
    )
    tally(case, result)


@examples(0.5)
@given(case=engine_cases(new_tokens=st.integers(2, 20)), data=st.data())
async def test_stops_after_an_end_token(case, data):
    free = reference_tokens(case.models().target, case.prompt, case.max_new_tokens)
    stop = free[data.draw(st.integers(0, len(free) - 1), label="end token at")]
    note(f"end token {stop}; free run {free}")
    result = await assert_matches_sequential(
        case.engine_config(eos_id=stop), case.prompt, case.max_new_tokens
    )
    assert result.tokens == free[: free.index(stop) + 1]


@examples(0.25)
@given(case=engine_cases(new_tokens=st.integers(2, 20)), data=st.data())
async def test_stops_after_a_stop_string(case, data):
    config = case.engine_config(tokenizer="words")
    free = reference_tokens(config.target, case.prompt, case.max_new_tokens)
    word = f"t{free[data.draw(st.integers(0, len(free) - 1), label='stop word at')]}"
    result = await assert_matches_sequential(config, case.prompt, case.max_new_tokens, stop=[word])
    spelled = "".join(f" t{t}" for t in result.tokens)  # the tiny tokenizer's words
    assert result.text == spelled[: spelled.index(word)]  # the stop string left out


@examples(0.4)
@given(case=engine_cases(tree_shapes=drafting), data=st.data())
async def test_requests_on_one_engine_each_equal_sequential_reference(case, data):
    """KV caches, the prefetcher's passes and the drafter's state start clean per request:
    after a request abandoned mid-stream, one after another, and several at once."""
    config = case.engine_config()
    others = data.draw(st.lists(prompts(case.args.vocab_size), min_size=1, max_size=2))
    abandon_after = data.draw(st.integers(1, 6), label="abandon after")
    results: dict[int, list[int]] = {}

    async def generate(engine, index, prompt):
        results[index] = (await engine.generate(prompt, max_new_tokens=case.max_new_tokens)).tokens

    async with Engine.open(config) as engine:
        seen = 0
        async for _ in engine.stream(case.prompt, max_new_tokens=case.max_new_tokens + 6):
            seen += 1
            if seen >= abandon_after:
                break
        everything = [case.prompt, *others]
        for index, prompt in enumerate(everything):
            await generate(engine, index, prompt)
        async with trio.open_nursery() as nursery:
            for index, prompt in enumerate(everything):
                nursery.start_soon(generate, engine, len(everything) + index, prompt)
    for index, prompt in enumerate(everything * 2):
        expected = reference_tokens(config.target, prompt, case.max_new_tokens)
        assert results[index] == expected, f"request {index}, prompt {prompt}"


@examples(0.5)
@given(
    case=engine_cases(
        relations=st.just("identical"),
        tree_shapes=trees(kinds=("chain", "static")),
        predictors=early_exits(("off", "probe_only")),
        windows=st.none(),
    )
)
async def test_identical_draft_is_always_accepted(case):
    """Not exactness but its mirror: a draft equal to the target, seeing the whole text,
    proposes the target's own greedy path, so without pruning every step but the last takes
    the whole fixed tree's depth. (A pruner may drop the right branch: that costs speed,
    never output.)"""
    result = await assert_matches_sequential(case.engine_config(), case.prompt, case.max_new_tokens)
    depth = len(TreeSpec.parse(case.tree).widths)
    assert [s.new_tokens for s in result.steps[:-1]] == [depth + 1] * (len(result.steps) - 1)


async def test_trees_that_copy_from_the_text_keep_the_output_exact():
    """A target that repeats itself: gain-cost trees take tokens copied from the committed
    text (StepStats.copied), and the output is still sequential greedy's."""
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="gaincost")
    result = await assert_matches_sequential(config, [5, 6, 7, 8, 9] * 4, 40)
    assert any(s.copied for s in result.steps)
    off = msgspec.structs.replace(config, lookup=False)
    result = await assert_matches_sequential(off, [5, 6, 7, 8, 9] * 4, 40)
    assert not any(s.copied for s in result.steps)


async def test_copies_alone_keep_the_output_exact_without_a_draft_model():
    """Tree `lookup`: no draft model is loaded, each step verifies the chain of tokens
    copied from the text, and a target that repeats itself takes several a pass; the
    output is sequential greedy's, and seeded sampling's."""
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="lookup")
    result = await assert_matches_sequential(config, [5, 6, 7, 8, 9] * 4, 40)
    assert any(s.copied for s in result.steps)
    assert any(s.new_tokens > 1 for s in result.steps)
    assert all(s.draft_rounds == () for s in result.steps)
    sampled = Sampling(temperature=0.8, seed=3)
    await assert_matches_sequential(config, [5, 6, 7, 8, 9] * 4, 40, sampling=sampled)


async def test_trees_drafted_ahead_and_carried_over_keep_the_output_exact(slow_flash, monkeypatch):
    """A draft equal to the target, a calibrator that has learned so, and passes that
    flash and jitter make long: rounds ahead run below the sent trees, the commit ends
    them midway or not, and a target's next token found among their nodes carries its
    subtree over as the next tree (StepStats.drafted_ahead); the output stays sequential
    greedy's."""
    monkeypatch.setattr(policy_setup, "AcceptanceCalibrator", lambda: learned(0.95))
    pair = model_pair(msgspec.structs.replace(TINY_ARGS, n_layers=6), "identical", 0)
    config = EngineConfig(
        target=str(pair.target),
        draft=str(pair.draft),
        tree="gaincost",
        draft_ahead=True,
        dram_budget=minimum_budget(read_manifest(pair.target)),  # every layer streams
        throttle="ufs3.1",
        jitter_seconds=0.05,
        early_exit="probe_only",
    )
    carried = []
    for prompt in ([5, 6, 7, 8, 9], [1, 2, 3], [10, 11, 7, 30]):
        result = await assert_matches_sequential(config, prompt, 40)
        carried += [s.drafted_ahead for s in result.steps]
    assert any(carried), carried


@examples(0.5)
@given(
    case=engine_cases(
        models=model_args(vocab_size=BYTE_VOCAB),
        tree_shapes=drafting,
        sampling=st.one_of(st.just(GREEDY), samplings()),
        new_tokens=st.integers(1, 32),
    ),
    grammar=grammars(),
)
async def test_constrained_decoding_equals_sequential_constrained_decoding(case, grammar):
    """The target's choice at each node takes the mask of the grammar along the node's path,
    so the engine emits what one-token decoding under the same grammar emits, whatever the
    draft proposed (here it knows nothing of the grammar)."""
    config = case.engine_config(tokenizer="bytes")
    result = await assert_matches_sequential(
        config, case.prompt, case.max_new_tokens, sampling=case.sampling, grammar=grammar
    )
    tally(case, result)
