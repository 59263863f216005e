"""The prompt cache's files (#64, E2 and E5): nothing in `--prompt-cache-dir` can poison a
request or stop the engine. A header is checked by its checksum and against the models'
shapes and dtypes; only regular files of the size their header gives are read (no link, no
FIFO, no device, no hole); a bad file goes with one warning; a dead writer's partial file
goes, a live one's counts; a directory that cannot be written is read, never written."""

from __future__ import annotations

import dataclasses
import logging
import os

import msgspec
import pytest
import torch

from lever_actors.device import kv_files
from lever_actors.device.checksums import checksum
from lever_actors.device.kv_files import (
    HEADER_LENGTH_BYTES,
    PREAMBLE_BYTES,
    SUFFIX,
    CachedPrefix,
    Header,
    KVFiles,
    KVShape,
)
from lever_actors.model.kv_cache import KVCache
from lever_actors.testing.checkpoints import TINY_ARGS

TOKENS = (3, 1, 4, 1, 5)
SHAPES = (KVShape.of(TINY_ARGS, torch.float64), None)


def prefix() -> CachedPrefix:
    cache = KVCache(TINY_ARGS, len(TOKENS) + 4, torch.float64)
    shape = (TINY_ARGS.n_kv_heads, len(TOKENS), TINY_ARGS.head_dim)
    for layer in range(TINY_ARGS.n_layers):
        cache.write(layer, torch.randn(shape, dtype=torch.float64), torch.randn(shape).double())
    cache.commit(len(TOKENS))
    return CachedPrefix(TOKENS, cache.prefix(len(TOKENS)), None)


@pytest.fixture
def saved(tmp_path):
    """The directory's one file, written by a KVFiles as an engine writes it."""
    KVFiles(tmp_path, "key", 2**30, SHAPES).save(prefix())
    [path] = (tmp_path / "key").glob(f"*{SUFFIX}")
    return path


def header_of(path) -> tuple[Header, bytes]:
    data = path.read_bytes()
    length = int.from_bytes(data[:HEADER_LENGTH_BYTES], "little")
    encoded = data[PREAMBLE_BYTES : PREAMBLE_BYTES + length]
    return msgspec.msgpack.decode(encoded, type=Header), data[PREAMBLE_BYTES + length :]


def rewrite(path, header: Header, tensors: bytes) -> None:
    """The file with another header, its checksum made to match: only the check against
    the models can refuse it."""
    encoded = msgspec.msgpack.encode(header)
    preamble = len(encoded).to_bytes(8, "little") + checksum(encoded).to_bytes(8, "little")
    path.write_bytes(preamble + encoded + tensors)


def fresh(tmp_path, caplog) -> KVFiles:
    with caplog.at_level(logging.WARNING, logger="lever_actors"):
        return KVFiles(tmp_path, "key", 2**30, SHAPES)


def test_a_flipped_bit_in_the_header_is_caught_by_its_checksum(tmp_path, saved, caplog):
    data = bytearray(saved.read_bytes())
    data[PREAMBLE_BYTES + 2] ^= 0x01  # inside the header's tokens
    saved.write_bytes(bytes(data))
    assert fresh(tmp_path, caplog).index == {}
    assert "its header's checksum does not match" in caplog.text and not saved.exists()


@pytest.mark.parametrize(
    "edit",
    [
        lambda r: msgspec.structs.replace(r, dtype="int64"),  # another of the same size
        lambda r: msgspec.structs.replace(r, shape=(r.shape[1], r.shape[0], *r.shape[2:])),
    ],
    ids=["dtype", "shape"],
)
def test_a_header_that_is_not_the_models_is_refused(tmp_path, saved, caplog, edit):
    header, tensors = header_of(saved)
    keys, *rest = header.target
    rewrite(saved, msgspec.structs.replace(header, target=(edit(keys), *rest)), tensors)
    files = fresh(tmp_path, caplog)
    with caplog.at_level(logging.WARNING, logger="lever_actors"):
        assert files.load(TOKENS) is None
    assert "not the model's shape or dtype" in caplog.text and not saved.exists()


def test_a_negative_shape_is_refused_as_the_header_is_read(tmp_path, saved, caplog):
    header, tensors = header_of(saved)
    keys, *rest = header.target
    bad = msgspec.structs.replace(keys, shape=(-1, *keys.shape[1:]))
    rewrite(saved, msgspec.structs.replace(header, target=(bad, *rest)), tensors)
    assert fresh(tmp_path, caplog).index == {}
    assert "Expected `int` >= 0" in caplog.text and not saved.exists()


def test_a_header_length_past_the_file_is_skipped_without_reading(tmp_path, saved, caplog):
    data = saved.read_bytes()
    saved.write_bytes((2**62).to_bytes(8, "little") + data[HEADER_LENGTH_BYTES:])
    assert fresh(tmp_path, caplog).index == {}
    assert "passes its size" in caplog.text


def test_a_valid_file_with_a_hole_after_it_is_refused_before_its_tensors_are_read(
    tmp_path, saved, caplog, monkeypatch
):
    size = saved.stat().st_size
    os.truncate(saved, size + (3 << 30))  # a sparse 3 GiB tail: nothing on disk
    files = fresh(tmp_path, caplog)
    reads = []
    monkeypatch.setattr(kv_files, "_read", lambda *a: reads.append(a))
    with caplog.at_level(logging.WARNING, logger="lever_actors"):
        assert files.load(TOKENS) is None
    assert reads == [] and f"where its header says {size}" in caplog.text


@pytest.mark.parametrize("device", [True, False], ids=["to-a-device", "to-a-file"])
def test_a_link_is_never_followed_and_its_target_is_untouched(tmp_path, saved, caplog, device):
    target = "/dev/zero" if device else str(tmp_path / "elsewhere.kv")
    if not device:
        os.replace(saved, target)  # a valid file, but only a link to it in the directory
    link = tmp_path / "key" / f"x{SUFFIX}"
    link.symlink_to(target)
    assert link not in fresh(tmp_path, caplog).index.values()
    assert "Too many levels of symbolic links" in caplog.text
    assert not os.path.lexists(link) and os.path.exists(target)


def test_a_fifo_does_not_hang_the_start(tmp_path, caplog):
    directory = tmp_path / "key"
    directory.mkdir()
    fifo = directory / f"x{SUFFIX}"
    os.mkfifo(fifo)
    assert fresh(tmp_path, caplog).index == {}  # no writer: opened non-blocking, refused
    assert "not a regular file" in caplog.text and not fifo.exists()


def test_a_dead_writers_partial_file_goes_and_a_live_ones_counts(tmp_path, saved, caplog):
    whole = saved.stat().st_size
    dead = saved.with_name(f".{saved.name}.{2**22 + 12345}")  # above pid_max's default
    live = saved.with_name(f".{saved.name}.{os.getpid()}")
    for partial in (dead, live):
        partial.write_bytes(b"\0" * 100)
    files = fresh(tmp_path, caplog)
    assert not dead.exists() and live.exists()
    assert files.nbytes == whole + 100


def test_a_directory_it_may_not_write_is_read_and_never_written(
    tmp_path, saved, caplog, monkeypatch
):
    monkeypatch.setattr(kv_files.os, "access", lambda path, mode: False)  # root may write all
    files = fresh(tmp_path, caplog)
    assert caplog.text.count("prompt_cache.read_only") == 1
    loaded = files.load(TOKENS)
    assert loaded is not None and torch.equal(loaded.target.keys, header_keys(saved))
    files.save(dataclasses.replace(prefix(), tokens=(9, 9, 9, 9, 9)))
    assert list((tmp_path / "key").iterdir()) == [saved]


def header_keys(path) -> torch.Tensor:
    header, tensors = header_of(path)
    keys = header.target[0]
    count = keys.shape[0] * keys.shape[1] * keys.shape[2] * keys.shape[3]
    return torch.frombuffer(bytearray(tensors[: count * 8]), dtype=torch.float64).reshape(
        keys.shape
    )


def test_another_keys_directory_unused_for_a_month_goes(tmp_path, caplog):
    month_ago = os.stat(tmp_path).st_mtime - kv_files.STALE_KEY_SECONDS - 60
    stale, fresh_key, shared = (tmp_path / name for name in ("old", "new", "shared"))
    for directory in (stale, fresh_key, shared):
        directory.mkdir()
        (directory / f"a{SUFFIX}").write_bytes(b"x")
    os.utime(stale / f"a{SUFFIX}", (month_ago, month_ago))
    os.utime(shared / f"a{SUFFIX}", (month_ago, month_ago))
    (shared / "notes.txt").write_text("not ours")
    fresh(tmp_path, caplog)
    assert not stale.exists()  # its files and the directory
    assert (fresh_key / f"a{SUFFIX}").exists()  # used within the month
    assert not (shared / f"a{SUFFIX}").exists() and (shared / "notes.txt").exists()
