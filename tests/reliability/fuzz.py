"""What the fuzzers share: example counts, random JSON, edits at a path in a JSON value,
and the one property: a load ends in a CheckpointError or in a consistent checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import event, settings
from hypothesis import strategies as st

from lever_actors.checkpoints.checkpoint import Checkpoint
from lever_actors.errors import CheckpointError
from tests.reliability.tiny import assert_consistent

JsonPath = tuple[str | int, ...]
DELETE: Any = object()  # an edit's value that removes the key or item instead

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),  # near the tiny models' sizes, where a wrong value can still load
    st.integers(),
    st.floats(),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def examples(share: float) -> settings:
    """This fuzzer's share of the profile's examples (150 under ci, 1000 under thorough)."""
    return settings(max_examples=max(1, round(settings.default.max_examples * share)))


def paths(value: Any, prefix: JsonPath = ()) -> Iterator[JsonPath]:
    """Every path to a part of a JSON value, the whole value first."""
    yield prefix
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, part in items:
        yield from paths(part, (*prefix, key))


def edited(value: Any, path: JsonPath, new: Any) -> Any:
    """A copy of the JSON `value` with the part at `path` replaced by `new` (or deleted)."""
    if not path:
        return None if new is DELETE else new
    head, rest = path[0], path[1:]
    copy = dict(value) if isinstance(value, dict) else list(value)
    if rest:
        copy[head] = edited(copy[head], rest, new)
    elif new is DELETE:
        del copy[head]
    else:
        copy[head] = new
    return copy


def load_or_refuse(load: Callable[[], Checkpoint]) -> None:
    """The property: `load` raises CheckpointError, or returns a consistent checkpoint.
    Any other exception propagates and fails the test."""
    try:
        checkpoint = load()
    except CheckpointError as refused:
        event(f"refused: {str(refused).split(': ', 1)[-1][:40]}")
        return
    event("loaded")
    assert_consistent(checkpoint)
