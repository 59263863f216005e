"""What a plan is chosen by, before either model loads (plan/decode.py): this machine's
target pass over a number of rows, its flash bandwidth and a node's projection, measured
once per machine and layout with every layer streamed and the head resident (profiler.py,
a second or two); and a draft forward's curve, saved when an engine first profiles its
draft, else estimated from the target's."""

from __future__ import annotations

from pathlib import Path

from lever_actors.config import EngineConfig
from lever_actors.device.budget import head_resident_budget, plan_residency
from lever_actors.device.manifest import Manifest
from lever_actors.model.native import requested
from lever_actors.paths import cache_key, default_cache_dir, file_identity
from lever_actors.policy.cost_model import CostModel, Curve
from lever_actors.policy.profile_cache import cached_costs, keep, machine_identity, read_kept
from lever_actors.policy.profiler import profile_costs
from lever_actors.target import FlashTarget

# a draft forward against a target pass over as many nodes, until the draft is measured:
# small forwards cost each layer's fixed work more than its bytes (the real pair's 0.5B draft
# took 22 ms for one node against the 1.5B target's 28 ms, on a 2-core Xeon)
UNMEASURED_DRAFT_SHARE = 0.8


def target_figures(config: EngineConfig, manifest: Manifest, room: int) -> CostModel:
    """The target's costs on this machine with every layer streamed; blocking. Measured
    where none are kept, in `room` bytes of target weights at most."""
    directory = default_cache_dir() / "profiles"
    # the head resident where there is room: a projection's own time (a streamed head's
    # read is priced apart)
    budget = min(room, head_resident_budget(manifest, config.ring_slots))
    key = cache_key(
        {
            "figures": "target",
            "machine": machine_identity(),
            "kernels": requested().value,
            "target": file_identity(Path(config.target) / "manifest.json"),
            "throttle": config.throttle,
            "verify": config.verify_checksums,
            "head_resident": budget >= head_resident_budget(manifest, config.ring_slots),
        }
    )

    def probe() -> CostModel:
        plan = plan_residency(manifest, budget, config.ring_slots)
        target = FlashTarget(
            Path(config.target), plan, throttle=config.throttle, verify=config.verify_checksums
        )
        try:
            return profile_costs(target, None)
        finally:
            target.close()

    return cached_costs(directory, key, probe)


def draft_curve(config: EngineConfig, target: CostModel) -> Curve:
    """A draft forward by nodes: as measured by an engine that profiled the config's draft
    on this machine, else the target's pass scaled by UNMEASURED_DRAFT_SHARE."""
    measured = read_kept(_draft_path(config), Curve) if config.draft is not None else None
    if measured is not None:
        return measured
    share = UNMEASURED_DRAFT_SHARE
    return Curve(list(target.verify.sizes), [s * share for s in target.verify.seconds])


def save_draft_curve(config: EngineConfig, curve: Curve) -> None:
    """Keep a measured draft curve for the plans of later engines."""
    keep(_draft_path(config), curve)


def _draft_path(config: EngineConfig) -> Path:
    assert config.draft is not None  # a draft named by its file
    key = cache_key(
        {
            "figures": "draft",
            "machine": machine_identity(),
            "kernels": requested().value,
            "draft": file_identity(Path(config.draft)),
            "draft_formats": [config.draft_dtype, config.draft_weights, config.draft_vocabulary],
        }
    )
    return default_cache_dir() / "profiles" / f"draft-{key}.msgpack"
