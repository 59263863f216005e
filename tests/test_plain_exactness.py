"""The exactness contract on the plain path (#63), as properties: whatever tokens a pass
verifies beside its own (copies from the text, or anything at all), the plain path emits
exactly its one-token decoding, greedy or seeded, up to the same stop (a tiny bf16 model with
q4k and q6 matrices, the plain kernels' formats on every instruction set)."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from lever_actors.model import plain_model
from lever_actors.model.sampling import GREEDY, Sampling
from lever_actors.policy.plain_copies import CopyProposer
from lever_actors.testing import samplings
from tests.model.test_fused import quantized_model
from tests.model.test_native import needs_native
from tests.model.test_plain import plain_of

VOCAB = 1024  # bf16_args' vocabulary


@functools.cache
def model(weights: str) -> plain_model.Model:
    return plain_of(quantized_model(weights))


def one_a_pass(weights: str, prompt: list[int], n: int, stop, sampling: Sampling) -> list[int]:
    return list(plain_model.token_stream(model(weights), prompt, n, stop, sampling))


class Scripted:
    """Proposes what a script says, pass after pass: the reference's next tokens with one
    changed at a drawn place, or tokens drawn at random."""

    def __init__(self, data, reference: list[int], cap: int) -> None:
        self.data, self.reference, self.cap = data, reference, cap
        self.made: int | None = None  # tokens decoded so far; None before the prompt's pass

    def proposed(self, committed):
        self.made = 0 if self.made is None else self.made + len(committed)
        ahead = self.reference[self.made : self.made + self.cap]
        n = self.data.draw(st.integers(0, self.cap), label="proposed")
        guess = list(ahead[:n])
        if guess and self.data.draw(st.booleans(), label="spoiled"):
            at = self.data.draw(st.integers(0, len(guess) - 1), label="at")
            guess[at] = (guess[at] + 1) % VOCAB
        if self.data.draw(st.booleans(), label="random tail"):
            guess += self.data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=3))
        return guess[: self.cap]

    def verified(self, rows, proposed, taken, seconds):
        pass


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)


@needs_native
@settings(max_examples=max(1, settings.default.max_examples // 4))
@given(
    weights=st.sampled_from(["q4k", "q6"]),
    prompt=prompts,
    n=st.integers(1, 20),
    sampling=st.one_of(st.just(GREEDY), samplings()),
    stop_at=st.none() | st.integers(0, 19),
    data=st.data(),
)
def test_any_tokens_verified_beside_a_pass_leave_the_one_token_decoding(
    weights, prompt, n, sampling, stop_at, data
):
    reference = one_a_pass(weights, prompt, n, frozenset(), sampling)
    stop = frozenset() if stop_at is None else frozenset({reference[min(stop_at, n - 1)]})
    expected = one_a_pass(weights, prompt, n, stop, sampling)
    script = Scripted(data, reference, cap=data.draw(st.integers(1, 6), label="cap"))
    got = list(plain_model.token_stream(model(weights), prompt, n, stop, sampling, script))
    assert got == expected


@needs_native
@settings(max_examples=max(1, settings.default.max_examples // 8))
@given(
    phrase=st.lists(st.integers(0, VOCAB - 1), min_size=3, max_size=6),
    repeats=st.integers(2, 5),
    n=st.integers(1, 24),
    sampling=st.one_of(st.just(GREEDY), samplings()),
)
def test_copies_from_a_repetitive_text_leave_the_one_token_decoding(phrase, repeats, n, sampling):
    prompt = phrase * repeats
    expected = one_a_pass("q4k", prompt, n, frozenset(), sampling)
    copies = CopyProposer()
    got = list(plain_model.token_stream(model("q4k"), prompt, n, frozenset(), sampling, copies))
    assert got == expected
    assert sum(copies.committed) >= len(got)  # the last pass may commit past the end
