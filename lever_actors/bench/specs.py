"""Each mode's spec: plain data that says what to run and can travel to a child process
(bench/child.py), which reads it before it loads anything; and a planned mode, a spec with
its ModeInfo. Torch-free: a child of the plain path never loads torch."""

from __future__ import annotations

import msgspec

from lever_actors.bench.llamacpp import LlamaCppSpec
from lever_actors.bench.results import ModeInfo
from lever_actors.config import EngineConfig


class MemoryARSpec(msgspec.Struct, frozen=True, tag="memory-ar"):
    target: str
    dtype: str


class EngineSpec(msgspec.Struct, frozen=True, tag="engine"):
    config: EngineConfig


class PlainSpec(msgspec.Struct, frozen=True, tag="plain"):
    """The plain path (bench/plain_mode.py): `config` names the target layout and the memory
    the plan may count on, as the engine's would."""

    config: EngineConfig


class PeerSpec(msgspec.Struct, frozen=True, tag="peer"):
    model: str  # an HF directory, or a .gguf file (transformers dequantizes it)
    dtype: str
    max_memory_bytes: int | None = None  # DRAM for the target's weights; None: all
    offload_folder: str | None = None
    assistant: str | None = None  # HF directory of the draft
    assistant_dtype: str | None = None
    evict: tuple[str, ...] = ()  # files and folders to drop from DRAM before each prompt


ModeSpec = MemoryARSpec | EngineSpec | PlainSpec | PeerSpec | LlamaCppSpec


class PlannedMode(msgspec.Struct, frozen=True):
    info: ModeInfo
    spec: ModeSpec
