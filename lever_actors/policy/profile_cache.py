"""The start-up profile (profiler.py) kept per target layout, residency plan, draft and
machine, so that an engine opens without measuring again: on the real pair the profile
took 1.7 s of a start-up that should take a few. Any change to one of them (another CPU,
torch or lever_actors version, a new layout or draft file, another budget) measures anew;
the cost model still learns from every step as before."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec
import torch

import lever_actors
from lever_actors.config import EngineConfig
from lever_actors.logs import get_logger
from lever_actors.machine import cpu_flags, cpu_name
from lever_actors.model.native import requested
from lever_actors.paths import cache_key, file_identity
from lever_actors.policy.cost_model import CostModel
from lever_actors.target import FlashTarget

log = get_logger(__name__)
T = TypeVar("T")


def profile_key(config: EngineConfig, target: FlashTarget) -> str:
    """Names the profile of this target, its plan and the config's draft on this machine."""
    plan = target.plan
    parts = weights_identity(config, target) | {
        "streamed": list(plan.streamed_layers),
        "head_streamed": target.lm_head is None,
    }
    return cache_key(parts)


def weights_identity(config: EngineConfig, target: FlashTarget) -> dict[str, object]:
    """What the values this target and the config's draft compute depend on, this machine
    included; not where the target's layers are held."""
    return {
        "machine": machine_identity(),
        "kernels": requested().value,
        "target": file_identity(target.store.directory / "manifest.json"),
        "draft": file_identity(Path(config.draft)) if config.draft else None,
        "draft_formats": [config.draft_dtype, config.draft_weights, config.draft_vocabulary],
    }


def machine_identity() -> str:
    """The CPU (model and flags), its cores and torch's threads, torch and our versions."""
    return "|".join(
        [
            cpu_name(),
            hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16],
            str(os.cpu_count()),
            str(torch.get_num_threads()),
            torch.__version__,
            lever_actors.__version__,
        ]
    )


def cached_costs(directory: Path, key: str, profile: Callable[[], CostModel]) -> CostModel:
    """The profile saved as `key` in `directory`, else `profile()`, saved for next time."""
    path = directory / f"{key}.msgpack"  # not JSON: a resident plan's bandwidth is inf
    cost = read_kept(path, CostModel)
    if cost is None:
        cost = profile()
        keep(path, cost)
    return cost


def read_kept(path: Path, kind: type[T]) -> T | None:
    """What `keep` wrote at `path`; None where nothing readable is there (logged)."""
    try:
        return msgspec.msgpack.decode(path.read_bytes(), type=kind)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as error:
        log.warning("profile.unreadable", path=str(path), error=str(error))
        return None


def keep(path: Path, value: object) -> None:
    """Write `value` to `path` for later engines, whole or not at all (a failure is logged)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_bytes(msgspec.msgpack.encode(value))
        os.replace(partial, path)
    except OSError as error:
        log.warning("profile.not_saved", path=str(path), error=str(error))
