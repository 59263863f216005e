"""A planned mode opened in this process. Torch-free itself: a child process of the plain
path (bench/child.py) opens its mode here and never loads torch; the modes that compute on
torch are imported only where one is opened."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from lever_actors.bench.llamacpp import LlamaCppMode, LlamaCppSpec
from lever_actors.bench.mode import Mode
from lever_actors.bench.plain_mode import PlainMode
from lever_actors.bench.specs import MemoryARSpec, PeerSpec, PlainSpec, PlannedMode

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
        return PlainMode(info, spec)
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
