"""A planned mode opened in this process. Torch-free itself: a child process of the plain
path (bench/child.py) opens its mode here and never loads torch; the modes that compute on
torch are imported only where one is opened. Lever's auto plan takes the plain path where
`generate`'s would (plan/plain.py), under the memory the child finds."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from lever_actors.bench.llamacpp import LlamaCppMode, LlamaCppSpec
from lever_actors.bench.mode import Mode
from lever_actors.bench.plain_mode import PlainMode
from lever_actors.bench.specs import EngineSpec, MemoryARSpec, PeerSpec, PlainSpec, PlannedMode
from lever_actors.device.manifest import read_manifest
from lever_actors.plan.plain import plain_plan

if TYPE_CHECKING:  # torch's
    from lever_actors.draft import DraftModel


def open_in_process(planned: PlannedMode, drafts: dict[tuple[str, str], DraftModel] | None) -> Mode:
    """The Mode of a planned mode, to run in this process; engine modes share the drafts in
    `drafts` ((path, dtype) -> loaded draft), loading each once. Without `drafts` (a child
    process of one mode) an engine loads its draft on its own compute unit: a draft loaded
    on this thread would start a second OpenMP team, and every team then sleeps after
    each product (device/units.py)."""
    spec, info = planned.spec, planned.info
    if isinstance(spec, PlainSpec):
        return PlainMode(info, spec.config)
    if isinstance(spec, EngineSpec) and spec.config.plan == "auto":
        # as `generate` decides: the plain path wherever it holds the whole target
        manifest = read_manifest(Path(spec.config.target))
        plain, _ = plain_plan(spec.config, manifest)
        if plain is not None:
            return PlainMode(info, spec.config, plain)
    if isinstance(spec, LlamaCppSpec):
        return LlamaCppMode(info, spec)
    modes = importlib.import_module("lever_actors.bench.modes")  # torch's, loaded only now
    if isinstance(spec, PeerSpec):
        return importlib.import_module("lever_actors.bench.peer").PeerHF(info, spec)
    if isinstance(spec, MemoryARSpec):
        return modes.MemoryAR(info, spec)
    config = spec.config
    if config.draft is None or drafts is None:
        return modes.EngineMode(info, spec)
    key = (config.draft, config.draft_dtype)
    if key not in drafts:
        loading = importlib.import_module("lever_actors.draft")
        drafts[key] = loading.load_draft(config.draft, config.draft_dtype)
    return modes.EngineMode(info, spec, drafts[key])
