"""The built kernels' cache: a library is built once, stamped with its size and hash, and
rebuilt before anything loads it where it is not the file its stamp describes; one process
builds at a time. A stand-in for the compiler writes the library, so no g++ runs."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from lever_actors.model import kernel_build, native_build
from lever_actors.model.native_build import AVX2
from lever_actors.paths import exclusive

LIBRARY = bytes(range(256)) * 64  # what the stand-in compiler builds


class Cache:
    """A kernel cache in a temporary directory whose compiler writes LIBRARY (no g++ runs),
    and whose loader records the bytes of what it loads."""

    def __init__(self, monkeypatch, directory: Path) -> None:
        self.library = directory / "kernels" / "avx2-0123456789abcdef.so"
        self.builds: list[Path] = []
        self.loaded: list[bytes] = []
        monkeypatch.setattr(native_build, "_library_path", lambda isa: self.library)
        monkeypatch.setattr(native_build, "_compile", self._compile)
        monkeypatch.setattr(native_build, "_supported", lambda: (AVX2, ""))
        monkeypatch.setattr(torch.ops, "load_library", self._load)

    def _compile(self, isa, out: Path) -> None:
        self.builds.append(out)
        out.write_bytes(LIBRARY)

    def compile_avx2(self, out: Path) -> None:
        self._compile(AVX2, out)

    def _load(self, path: str) -> None:
        self.loaded.append(Path(path).read_bytes())


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Cache:
    return Cache(monkeypatch, tmp_path)


def test_a_built_library_is_stamped_with_its_size_and_hash_and_then_reused(cache):
    assert native_build._load() is AVX2
    assert native_build._load() is AVX2
    assert len(cache.builds) == 1 and cache.loaded == [LIBRARY, LIBRARY]
    stamp = cache.library.with_name(cache.library.name + ".sha256").read_text()
    assert stamp == f"{len(LIBRARY)} {hashlib.sha256(LIBRARY).hexdigest()}\n"
    listing = sorted(p.name for p in cache.library.parent.iterdir())
    assert listing == [cache.library.name, f"{cache.library.name}.sha256"]  # no partial left


@pytest.mark.parametrize(
    "damage",
    [
        lambda library, stamp: library.write_bytes(LIBRARY[:1000]),  # truncated: SIGBUS
        lambda library, stamp: library.write_bytes(bytes(len(LIBRARY))),  # garbage
        lambda library, stamp: stamp.unlink(),  # built before stamps, or cut off before one
        lambda library, stamp: stamp.write_bytes(b"\xff\xfe"),
    ],
    ids=["truncated", "garbage", "unstamped", "bad-stamp"],
)
def test_a_damaged_library_is_rebuilt_before_anything_loads_it(cache, caplog, damage):
    native_build._load()
    damage(cache.library, cache.library.with_name(cache.library.name + ".sha256"))
    assert native_build._load() is AVX2
    assert len(cache.builds) == 2
    assert cache.loaded == [LIBRARY, LIBRARY]  # the damaged file was never mapped
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage().startswith("rebuilding the cached kernels: not the file their")


def test_a_process_waits_for_anothers_build_and_takes_its_library(cache, caplog):
    caplog.set_level(logging.INFO, logger="lever_actors")
    took: list[Path] = []
    with exclusive(cache.library.parent):  # another process building
        waiter = threading.Thread(target=lambda: took.append(native_build._built(AVX2)))
        waiter.start()
        for _ in range(500):  # until it waits on the lock, at most 5 s
            if "waiting for another process's build" in caplog.text:
                break
            time.sleep(0.01)
        kernel_build.rebuild(cache.library, cache.compile_avx2, "avx2")
    waiter.join(timeout=10)
    assert took == [cache.library]
    assert len(cache.builds) == 1
    assert "waiting for another process's build" in caplog.text
