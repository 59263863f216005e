"""A request's options: built and checked once, from the struct or from flat keywords."""

from __future__ import annotations

import pytest

from lever_actors.errors import ConfigError
from lever_actors.model.sampling import Sampling
from lever_actors.options import GenerationOptions, generation_options, options_of


def test_keywords_build_the_same_options_as_the_struct():
    built = generation_options(max_new_tokens=9, stop=["\n"], temperature=0.5, top_k=3, seed=7)
    assert built == GenerationOptions(
        max_new_tokens=9, stop=("\n",), sampling=Sampling(temperature=0.5, top_k=3, seed=7)
    )
    greedy = generation_options()
    assert (greedy.max_new_tokens, greedy.stop, greedy.sampling.greedy) == (
        GenerationOptions().max_new_tokens,
        (),
        True,
    )


def test_a_seed_is_drawn_only_where_none_was_given():
    assert generation_options(temperature=1.0, seed=5).sampling.seed == 5
    drawn = {generation_options(temperature=1.0).sampling.seed for _ in range(4)}
    assert len(drawn) > 1


def test_options_and_their_keywords_together_are_refused():
    with pytest.raises(ConfigError, match="give options or max_new_tokens, not both"):
        options_of(GenerationOptions(), {"max_new_tokens": 3})


def test_an_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword arguments: max_tokens"):
        generation_options(max_tokens=3)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be positive"),
        ({"stop": "x"}, "stop must be a list of strings, not one string"),
        ({"stop": ["x", 3]}, "stop must be a list of strings"),
        ({"stop": ["x", ""]}, "expected no empty string"),
        ({"stop": [f"s{i}" for i in range(65)]}, "stop has 65 strings: expected 64 at most"),
    ],
)
def test_bad_options_are_refused_when_built(fields, message):
    with pytest.raises(ConfigError, match=message):
        GenerationOptions(**fields)
