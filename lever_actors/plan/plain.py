"""Whether a request runs on the plain path, without torch (plain_target.py), or on the
engine: decided in two steps, since the second counts the tokenizer the first lets load.

`refusal` looks at what is known before anything loads: the plan asked for (`ar` alone), the
sampling (greedy: seeded sampling draws torch's noise), the config's engine-only work (a
trace, spilled prefixes, a throttle, a fixed budget), the model and its formats, and this
CPU's kernels. `plain_memory` then makes the memory plan: the plain path needs every layer
and the LM head in DRAM beside room for a context, and keeps the embedding table too where
it fits (else its rows come from flash); `plain_context`, once it has loaded, the context."""

from __future__ import annotations

from typing import NamedTuple

from lever_actors.config import EngineConfig
from lever_actors.device.manifest import DTYPE_SIZES, Manifest
from lever_actors.errors import ConfigError
from lever_actors.model import kernel_build
from lever_actors.model.plain_model import unsupported
from lever_actors.model.sampling import Sampling
from lever_actors.model.shapes import position_bytes
from lever_actors.plain_target import embed_bytes, plain_formats
from lever_actors.plan.context import Context, plan_context
from lever_actors.plan.memory import MemoryPlan, memory_plan, read_process


class PlainPlan(NamedTuple):
    memory: MemoryPlan  # room for a context beside the target
    embed_resident: bool  # else the embedding table's rows are read from flash


def refusal(config: EngineConfig, manifest: Manifest, sampling: Sampling) -> str:
    """Why the plain path cannot run this request, or '' where it may (memory allowing)."""
    if config.plan != "ar":
        return "only the plan ar runs without torch"
    if not sampling.greedy:
        return "seeded sampling draws torch's noise"
    engine_only = {
        "trace": config.trace is not None,
        "prompt_cache_dir": config.prompt_cache_dir is not None,
        "throttle": config.throttle != "none",
        "dram_budget": config.dram_budget.kind != "auto",
    }
    asked = [name for name, given in engine_only.items() if given]
    if asked:
        return f"{', '.join(asked)} asks for the engine"
    why = unsupported(manifest.args) or plain_formats(manifest)
    if why:
        return why
    isa, why = kernel_build.supported((kernel_build.AVX512_VNNI, kernel_build.AVX2))
    if isa is None:
        return why
    if kernel_build.supported()[0] is kernel_build.AMX and _integer_matrices(manifest):
        return "AMX's tiles multiply int4 and int8 matrices by x unrounded, as ours do not"
    return ""


def plain_memory(config: EngineConfig, manifest: Manifest) -> tuple[PlainPlan | None, str]:
    """The memory plan of the plain path beside what the process holds now, or None and why
    not."""
    try:  # room for the context the request may fill beside the target
        memory = memory_plan(config, manifest, read_process(), draft=0)
    except ConfigError as error:
        return None, str(error)
    if memory.budget < manifest.file_bytes - embed_bytes(manifest):
        return None, f"{memory}: the layers and the LM head would stream"
    return PlainPlan(memory, memory.budget >= manifest.file_bytes), ""


def plain_context(config: EngineConfig, manifest: Manifest) -> Context:
    """Once the target is in: the context a request may fill (ctx_size, else what the memory
    left holds, at most the model's)."""
    reading = read_process()
    kv_bytes = position_bytes(manifest.args, DTYPE_SIZES[manifest.dtype])
    args = manifest.args
    return plan_context(config.ctx_size, args.max_seq_len, kv_bytes, reading.limit, reading.process)


def _integer_matrices(manifest: Manifest) -> bool:
    return any(t.format in ("int4", "int8") for e in manifest.extents for t in e.tensors)
