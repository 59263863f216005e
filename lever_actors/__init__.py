"""lever_actors: a flash-resident LLM served by speculative token trees, as Trio actors.

    from lever_actors import Engine, EngineConfig, real_pair

`Engine` (trio) and `AsyncEngine` (asyncio) serve requests under an `EngineConfig`; the
`lever-actors` command wraps both. The names below load on first use (PEP 562), so that
`import lever_actors` imports no torch.

The package reads as the architecture, each layer importing only those below it:
cli -> serve/bench/testing -> engine -> actors/plan -> policy -> target/draft ->
checkpoints -> device -> text/options -> model/channels/config -> plumbing -> errors/logs.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import TYPE_CHECKING

__version__ = "0.3.0"

# the public face: name -> the module that defines it
_PUBLIC = {
    "Engine": "lever_actors.engine.engine",
    "AsyncEngine": "lever_actors.engine.aio",
    "GenerationResult": "lever_actors.engine.results",
    "EngineConfig": "lever_actors.config",
    "real_pair": "lever_actors.checkpoints.real_pair",
    "GenerationOptions": "lever_actors.options",
    "Grammar": "lever_actors.model.grammar",
    "TokenEvent": "lever_actors.channels.messages",
    "LeverError": "lever_actors.errors",
    "CheckpointError": "lever_actors.errors",
    "CorruptLayoutError": "lever_actors.errors",
    "FetchError": "lever_actors.errors",
    "ConfigError": "lever_actors.errors",
    "ContextLengthError": "lever_actors.errors",
    "ConsumerStalledError": "lever_actors.errors",
    "DeadlineError": "lever_actors.errors",
    "EngineClosedError": "lever_actors.errors",
}
__all__ = [
    "AsyncEngine",
    "CheckpointError",
    "ConfigError",
    "ConsumerStalledError",
    "ContextLengthError",
    "CorruptLayoutError",
    "DeadlineError",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "FetchError",
    "GenerationOptions",
    "GenerationResult",
    "Grammar",
    "LeverError",
    "TokenEvent",
    "real_pair",
]

if TYPE_CHECKING:
    from lever_actors.channels.messages import TokenEvent
    from lever_actors.checkpoints.real_pair import real_pair
    from lever_actors.config import EngineConfig
    from lever_actors.engine.aio import AsyncEngine
    from lever_actors.engine.engine import Engine
    from lever_actors.engine.results import GenerationResult
    from lever_actors.errors import (
        CheckpointError,
        ConfigError,
        ConsumerStalledError,
        ContextLengthError,
        CorruptLayoutError,
        DeadlineError,
        EngineClosedError,
        FetchError,
        LeverError,
    )
    from lever_actors.model.grammar import Grammar
    from lever_actors.options import GenerationOptions


def __getattr__(name: str) -> object:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'lever_actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


# the module paths before 0.3, kept for one release: old path -> where it lives now
MOVED = {
    "lever_actors.aio": "lever_actors.engine.aio",
    "lever_actors.batch": "lever_actors.engine.batch",
    "lever_actors.loading": "lever_actors.engine.loading",
    "lever_actors.prefix_cache": "lever_actors.engine.prefix_cache",
    "lever_actors.results": "lever_actors.engine.results",
    "lever_actors.steps": "lever_actors.engine.steps",
    "lever_actors.wiring": "lever_actors.engine.wiring",
    "lever_actors.sequences": "lever_actors.engine.state",
    "lever_actors.context": "lever_actors.plan.context",
    "lever_actors.decode_plan": "lever_actors.plan.decode",
    "lever_actors.memory_plan": "lever_actors.plan.memory",
    "lever_actors.request": "lever_actors.options",
    "lever_actors.stop_text": "lever_actors.text.stop",
    "lever_actors.tool_calls": "lever_actors.text.tool_calls",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a module path from before 0.3 as the module that now holds it, with a
    warning. The import system stamps its spec on the module it gets; the module's own is
    put back, so that it stays itself (reload, pickling by name)."""

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec | None] = {}  # by old path

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> ModuleType:  # type: ignore[no-untyped-def]
        warnings.warn(
            f"{spec.name} moved to {MOVED[spec.name]}; the old path goes in 0.4",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(MOVED[spec.name])
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # already executed: only its own spec is put back
        module.__spec__ = self._own_specs.pop(module.__spec__.name)  # type: ignore[union-attr]


if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
