"""profile-disk reads whole aligned blocks and refuses sizes that would never finish."""

from __future__ import annotations

import pytest

from lever_actors.device.disk_profile import profile_disk
from lever_actors.device.manifest import ALIGNMENT
from lever_actors.errors import ConfigError


def test_reads_the_file_in_aligned_blocks(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * (ALIGNMENT // 256) * 10 + b"tail")
    profile = profile_disk(path, 3 * ALIGNMENT + 5)
    assert profile.block_bytes == 3 * ALIGNMENT
    assert profile.bytes_read == 10 * ALIGNMENT  # the unaligned tail is left out
    assert profile.bandwidth > 0


@pytest.mark.parametrize(
    ("block", "limit", "message"),
    [
        (0, None, "block size 0 B: at least"),
        (1000, None, "block size 1000 B: at least"),
        (ALIGNMENT, 100, "max bytes 100 B: at least"),
    ],
)
def test_sizes_below_one_aligned_block_are_refused(tmp_path, block, limit, message):
    path = tmp_path / "data"
    path.write_bytes(bytes(ALIGNMENT * 2))
    with pytest.raises(ConfigError, match=message):
        profile_disk(path, block, limit)


def test_a_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        profile_disk(tmp_path / "missing", ALIGNMENT)
