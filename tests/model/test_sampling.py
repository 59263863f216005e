"""Choosing tokens: greedy is the argmax bit for bit; seeded sampling is a function of
(seed, position) alone, row by row, and draws from the target's filtered softmax at the
temperature, which a chi-square test over a fixed set of seeds checks (and which rejects a
sampler at the wrong temperature)."""

from __future__ import annotations

import functools
import math
from collections import Counter

import numpy as np
import pytest
import torch

from lever_actors.checkpoints.hf import load_hf
from lever_actors.errors import ConfigError
from lever_actors.model.choosing import Chooser, RowLogprobs
from lever_actors.model.drawing import NUCLEUS_HEAD, filtered, gumbel
from lever_actors.model.sampling import GREEDY, MIN_TEMPERATURE, Sampling, seed_or_drawn
from lever_actors.model.sequential import sequential_cached, sequential_reference
from lever_actors.model.transformer import Transformer
from tests.tiny_hf import save_tiny, tiny_model

PROMPT = [1, 4, 2]
VOCAB = 8
SEEDS = range(3000)
TEMPERATURE = 2.5  # the tiny model's logits are far apart; this spreads its distribution
FILTERS = dict(top_k=6, top_p=0.97)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Transformer:
    hf = save_tiny(tiny_model("qwen2", seed=3, vocab=VOCAB), tmp_path_factory.mktemp("m") / "m")
    checkpoint = load_hf(hf, torch.float64)
    return Transformer(checkpoint.args, checkpoint.weights)


def test_temperature_zero_is_the_argmax_bit_for_bit():
    logits = torch.randn(5, 50, dtype=torch.bfloat16)
    assert Chooser(GREEDY).choose(logits, torch.arange(5)) == logits.argmax(-1).tolist()
    assert Chooser(GREEDY).draft_scores(logits, torch.arange(5)) is logits


def test_greedy_takes_each_dtypes_own_argmax():
    """bf16 is widened to float32 for a faster argmax, exactly (ties go to the first id);
    float64 is never narrowed, where a near-tie would merge."""
    row = torch.tensor([[0.5, 1.0, 1.0 + 1e-12, 1.0]], dtype=torch.float64)
    assert Chooser(GREEDY).choose(row, torch.tensor([0])) == [2]
    tied = torch.tensor([[0.5, 3.0, 3.0, -1.0]], dtype=torch.bfloat16)
    assert Chooser(GREEDY).choose(tied, torch.tensor([0])) == [1] == tied.argmax(-1).tolist()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(temperature=-0.1), "temperature = -0.1: expected >= 0"),
        (dict(temperature=math.nan), "temperature = nan: expected >= 0"),
        (dict(temperature=1e-300), "temperature = 1e-300: expected 0 (greedy) or at least 1e-06"),
        (dict(temperature=5e-324), "temperature = 5e-324: expected 0 (greedy) or at least 1e-06"),
        (dict(top_k=-1), "top_k = -1: expected >= 0"),
        (dict(top_p=0.0), "top_p = 0.0: expected in (0, 1]"),
        (dict(top_p=1.5), "top_p = 1.5: expected in (0, 1]"),
        (dict(min_p=1.0), "min_p = 1.0: expected in [0, 1)"),
        (dict(seed=-1), "seed = -1: expected in [0, 18446744073709551615]"),
    ],
)
def test_bad_settings_are_refused_by_name(fields, message):
    with pytest.raises(ConfigError) as raised:
        Sampling(**fields)
    assert str(raised.value) == message


def test_the_least_temperature_overflows_nothing_even_at_bf16s_largest_logits():
    logits = torch.tensor([[-3e38, 0.0, 3e38, 1e38]], dtype=torch.bfloat16)
    chooser = Chooser(Sampling(temperature=MIN_TEMPERATURE, seed=1))
    assert chooser.choose(logits, torch.tensor([0])) == [2]
    probs = torch.softmax(chooser.draft_scores(logits, torch.tensor([0])), dim=-1)
    assert probs.tolist() == [[0.0, 0.0, 1.0, 0.0]]  # no NaN: logits / T stay in float32


def test_a_seed_is_drawn_only_when_none_is_given():
    assert seed_or_drawn(7) == 7
    assert len({seed_or_drawn(None) for _ in range(4)}) == 4


def test_noise_depends_on_seed_and_position_alone():
    assert np.array_equal(gumbel(5, 11, 100), gumbel(5, 11, 100))
    assert not np.array_equal(gumbel(5, 11, 100), gumbel(5, 12, 100))
    assert not np.array_equal(gumbel(5, 11, 100), gumbel(6, 11, 100))


def test_a_rows_token_does_not_depend_on_its_batch():
    logits = torch.randn(9, 300, dtype=torch.float64)
    positions = torch.arange(20, 29)
    sampling = Sampling(temperature=0.8, top_p=0.9, seed=3)
    together = Chooser(sampling).choose(logits, positions)
    alone = [Chooser(sampling).choose(logits[i : i + 1], positions[i : i + 1])[0] for i in range(9)]
    assert together == alone


def test_cached_noise_is_the_noise_of_its_position():
    chooser = Chooser(Sampling(temperature=1.0, seed=9), kept_positions=2)
    logits = torch.zeros(4, 30, dtype=torch.float64)
    positions = torch.tensor([5, 6, 5, 7])  # 5 is evicted by 7 after its second use
    scores = chooser.draft_scores(logits, positions)
    for row, position in zip(scores, positions.tolist(), strict=True):
        assert torch.equal(row, noise32(9, position, 30))  # a draft ranks in float32
    again = chooser.draft_scores(logits[:1], torch.tensor([5]))[0]
    assert torch.equal(again, noise32(9, 5, 30))


def noise32(seed: int, position: int, vocab: int) -> torch.Tensor:
    return torch.from_numpy(gumbel(seed, position, vocab)).float()


def test_the_nucleus_of_a_flat_distribution_is_sorted_whole():
    """Past NUCLEUS_HEAD tokens the head does not hold top_p's mass: the slow path."""
    vocab = NUCLEUS_HEAD * 4
    flat = np.zeros(vocab)
    kept = np.isfinite(filtered(flat, Sampling(temperature=1, top_p=0.5)))
    count = int(kept.sum())
    assert vocab // 2 <= count <= vocab // 2 + 1  # the last one as the running sum rounds
    assert kept[:count].all()  # ties go to the lower ids, as a stable sort orders them


def test_the_nucleus_takes_equals_by_id_where_they_straddle_its_head():
    """One likely token (the last id), then thousands of equals: top_p reaches into the
    equals, which are kept from the lowest id up whichever of them the head sorted."""
    vocab = 3 * NUCLEUS_HEAD
    probs = np.full(vocab, 0.5 / (vocab - 1))
    probs[-1] = 0.5
    sampling = Sampling(temperature=1, top_p=0.5 + 10.5 * probs[0])
    kept = np.isfinite(filtered(np.log(probs), sampling))
    assert np.flatnonzero(kept).tolist() == [*range(11), vocab - 1]


def test_filters_keep_what_they_promise():
    logits = np.log([0.4, 0.3, 0.15, 0.1, 0.05])
    kept = lambda **f: np.isfinite(filtered(logits, Sampling(temperature=1, **f))).tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.7) == [True, True, False, False, False]  # 0.4 + 0.3 reaches 0.7
    assert kept(top_p=0.71) == [True, True, True, False, False]
    assert kept(top_p=0.1) == [True, False, False, False, False]  # the likeliest always stays
    assert kept(min_p=0.3) == [True, True, True, False, False]  # 0.1 < 0.3 x 0.4
    assert kept(top_k=3, top_p=0.8) == [True, True, False, False, False]  # of 0.4/0.85, 0.3/0.85


def test_logprobs_are_the_models_own_log_softmax():
    logits = torch.randn(3, 10, dtype=torch.float64)
    expected = [float(torch.log_softmax(logits[i], -1)[t]) for i, t in enumerate([4, 0, 9])]
    assert RowLogprobs(logits).of([4, 0, 9]) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert RowLogprobs(logits[:0]).of([]) == []


def test_top_logprobs_are_the_most_likely_tokens_as_logprobs_gives_them():
    logits = torch.randn(2, 10, dtype=torch.float64)
    top = RowLogprobs(logits).top(3)
    for row, alternatives in zip(logits, top, strict=True):
        ids = [token for token, _ in alternatives]
        assert ids == row.argsort(descending=True)[:3].tolist()
        assert [value for _, value in alternatives] == RowLogprobs(row.expand(3, -1)).of(ids)


@pytest.mark.parametrize("seed", [0, 1, 2**64 - 1])
def test_cached_decoding_samples_as_the_no_cache_oracle(model, seed):
    sampling = Sampling(temperature=1.3, top_k=5, seed=seed)
    assert sequential_cached(model, PROMPT, 12, sampling=sampling) == sequential_reference(
        model, PROMPT, 12, sampling=sampling
    )


# ------------------------------------------------------------------ the distribution


def expected_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """The target's filtered softmax at TEMPERATURE, computed here independently: the top
    k tokens, then the likeliest of them whose mass reaches top_p (renormalised)."""
    probs = torch.softmax(logits.double() / TEMPERATURE, -1)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[probs.argsort(descending=True)[: FILTERS["top_k"]]] = True
    probs = torch.where(keep, probs, 0.0)
    probs /= probs.sum()
    mass = 0.0
    for token in probs.argsort(descending=True).tolist():
        if mass >= FILTERS["top_p"]:
            probs[token] = 0.0
        mass += float(probs[token])
    return probs / probs.sum()


def next_logits(model: Transformer, tokens: list[int]) -> torch.Tensor:
    hidden = model.forward(torch.tensor(tokens), model.new_cache(len(tokens)))
    return model.logits(hidden[-1:])[0]


def first_two_tokens(model: Transformer, sampling: Sampling) -> tuple[int, int]:
    """sequential_reference's first two tokens after PROMPT, each context's logits computed
    once for all seeds (they depend on the context alone): 6,000 forwards made 18 s."""
    chooser = Chooser(sampling)
    first = chooser.choose(context_logits(model, tuple(PROMPT)), torch.tensor([len(PROMPT)]))
    after = (*PROMPT, *first)
    second = chooser.choose(context_logits(model, after), torch.tensor([len(after)]))
    return first[0], second[0]


@functools.cache
def context_logits(model: Transformer, tokens: tuple[int, ...]) -> torch.Tensor:
    """-> [1, vocab]: the logits after `tokens`, as sequential_reference computes them."""
    return next_logits(model, list(tokens))[None]


def chi_square(model: Transformer, sampling_at) -> tuple[float, float]:
    """(statistic, p-value) of the first two sampled tokens over SEEDS against their exact
    joint probability; categories expected fewer than 5 times are pooled."""
    first = expected_probabilities(next_logits(model, PROMPT))
    joint = {
        (a, b): float(first[a] * p)
        for a in range(VOCAB)
        if first[a] > 0
        for b, p in enumerate(expected_probabilities(next_logits(model, [*PROMPT, a])).tolist())
        if p > 0
    }
    counts = Counter(first_two_tokens(model, sampling_at(seed)) for seed in SEEDS)
    assert set(counts) <= set(joint), "a filtered-out pair was sampled"
    n = len(SEEDS)
    big = {pair for pair, p in joint.items() if p * n >= 5}
    observed = [counts[pair] for pair in big] + [n - sum(counts[pair] for pair in big)]
    expected = [joint[pair] * n for pair in big] + [n * (1 - sum(joint[p] for p in big))]
    if expected[-1] < 5:  # nothing left to pool
        observed, expected = observed[:-1], expected[:-1]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    dof = len(observed) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))
    return statistic, p_value


def test_first_two_tokens_follow_the_filtered_softmax(model):
    first = expected_probabilities(next_logits(model, PROMPT))
    assert (first > 0.05).sum() >= 3, "the test needs a spread-out distribution"
    statistic, p_value = chi_square(
        model, lambda seed: Sampling(temperature=TEMPERATURE, seed=seed, **FILTERS)
    )
    print(f"chi-square {statistic:.1f}, p = {p_value:.3f}")
    assert p_value > 0.01


def test_the_chi_square_test_rejects_a_sampler_at_the_wrong_temperature(model):
    _, p_value = chi_square(
        model, lambda seed: Sampling(temperature=TEMPERATURE * 1.3, seed=seed, **FILTERS)
    )
    assert p_value < 1e-6


def test_the_noise_of_fewer_tokens_is_the_first_of_the_whole_vocabularys():
    # a draft proposing from the first ids alone (draft_vocabulary) ranks them with the
    # noise the target draws for those ids
    assert np.array_equal(gumbel(3, 17, 65_536), gumbel(3, 17, 151_936)[:65_536])
