"""Checksums of stored weights, checked on every read unless the user turns them off.

A whole tensor has one checksum; a tensor read a row at a time (the embedding table) also
has one per CHUNK_BYTES piece, so that a row can be checked by reading only its chunks.
XXH3-64 hashes about 10 GB/s on one core here against zlib's CRC-32 at 2 GB/s, and
releases the GIL while it hashes.
"""

from __future__ import annotations

import xxhash

CHUNK_BYTES = 64 * 1024  # a multiple of the 4 KiB O_DIRECT block


def checksum(data) -> int:
    """XXH3-64 of a bytes-like object."""
    return xxhash.xxh3_64_intdigest(data)


def running_checksum() -> xxhash.xxh3_64:
    """`checksum` of bytes fed in pieces: update(piece) each in order, then intdigest()."""
    return xxhash.xxh3_64()


def chunk_checksums(data) -> tuple[int, ...]:
    """One checksum per CHUNK_BYTES piece of `data`, the last piece possibly shorter."""
    view = memoryview(data).cast("B")
    return tuple(checksum(view[at : at + CHUNK_BYTES]) for at in range(0, len(view), CHUNK_BYTES))
