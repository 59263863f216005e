"""`real_pair()`: the library's one line to the pair the CLI runs by default (#66, item 4)."""

from __future__ import annotations

import pytest

import lever_actors
from lever_actors.checkpoints import real_pair as pair
from lever_actors.errors import ConfigError


def test_real_pair_names_the_fetched_pair_with_the_fields_given(monkeypatch, tmp_path):
    fetched = []
    monkeypatch.setattr(
        pair, "real_target_layout", lambda cache, *a: fetched.append(cache) or cache / "t"
    )
    monkeypatch.setattr(pair, "real_model_path", lambda cache, key, *a: cache / key)
    config = lever_actors.real_pair(tmp_path, parallel=2)
    assert (config.target, config.draft, config.parallel) == (
        str(tmp_path / "t"),
        str(tmp_path / "draft"),
        2,
    )
    assert fetched == [tmp_path]


def test_real_pair_checks_its_fields_before_it_fetches(monkeypatch, tmp_path):
    def fetch(*args):
        raise AssertionError("fetched before the fields were checked")

    monkeypatch.setattr(pair, "real_target_layout", fetch)
    with pytest.raises(ConfigError, match="parallel"):
        lever_actors.real_pair(tmp_path, parallel=0)
