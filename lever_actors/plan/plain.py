"""Whether a request runs on the plain path, without torch (plain_target.py), or on the engine:
decided in two steps, since the second counts the tokenizer the first lets load.

`refusal` looks at what is known before anything loads: the plan asked for (`ar`, `lookup`
or `auto`; greedy or seeded, which draws as the engine does), the config's engine-only work
(a trace, spilled prefixes, a throttle, a fixed budget, requests at once), the model and its
formats, and this CPU's kernels. `plain_memory` then makes the memory plan: the plain path
needs every layer and the LM head in DRAM beside room for a context, and keeps the embedding
table too where it fits (else its rows come from flash). Under `auto` the plain path runs,
with copies from the text where they pay (policy/plain_copies.py), wherever it holds every
layer and the LM head: there the engine's trees, the draft beside the whole target, ran
slower than the plain path on code, chat and prose alike (under 2 and 3 GiB,
benchmarks/results/memory-curve-any-text-epyc.json), and its lookup and ar hold no more
and decode slower for torch's fixed memory and the actors' hand-offs. Where the layers
would stream, the engine's cost model chooses (a draft's trees pay while flash paces the
pass). `plain_context`, once it has loaded, the context."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import msgspec

from lever_actors.config import EngineConfig
from lever_actors.device.manifest import DTYPE_SIZES, Manifest
from lever_actors.errors import ConfigError
from lever_actors.model import kernel_build
from lever_actors.model.plain_model import unsupported
from lever_actors.model.shapes import position_bytes
from lever_actors.plain_target import embed_bytes, plain_formats
from lever_actors.plan.context import Context, plan_context
from lever_actors.plan.memory import MemoryPlan, memory_plan, read_process
from lever_actors.policy import plain_copies


class PlainPlan(NamedTuple):
    memory: MemoryPlan  # room for a context beside the target
    embed_resident: bool  # else the embedding table's rows are read from flash
    copies: int  # most copies from the text a pass verifies (lookup, auto); 0: one token

    @property
    def name(self) -> str:
        return "lookup" if self.copies else "ar"


def refusal(config: EngineConfig, manifest: Manifest) -> str:
    """Why the plain path cannot run this request, or '' where it may (memory allowing)."""
    if config.plan not in ("ar", "lookup", "auto"):
        return f"the plan {config.plan} runs on the engine" if config.plan else "a tree given"
    engine_only = {
        "trace": config.trace is not None,
        "prompt_cache_dir": config.prompt_cache_dir is not None,
        "throttle": config.throttle != "none",
        "dram_budget": config.dram_budget.kind != "auto",
        "parallel": config.parallel is not None,  # requests at once: the engine batches them
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


def plain_plan(config: EngineConfig, manifest: Manifest) -> tuple[PlainPlan | None, str]:
    """Both steps at once, where no tokenizer loads between them (the bench's ids): the
    plain path's plan, or None and why the engine runs the request."""
    why = refusal(config, manifest)
    return (None, why) if why else plain_memory(config, manifest)


def plain_memory(
    config: EngineConfig, manifest: Manifest, *, coming: int = 0, placed: int = 0
) -> tuple[PlainPlan | None, str]:
    """The memory plan of the plain path beside what the process holds now and `coming`
    bytes it will soon hold beside the target (a tokenizer's parse), less `placed` bytes of
    the target's weights it already holds, or None and why not."""
    reading = read_process()
    reading = msgspec.structs.replace(reading, process=reading.process + coming - placed)
    try:  # room for the context the request may fill beside the target
        memory = memory_plan(config, manifest, reading, draft=0)
    except ConfigError as error:
        return None, str(error)
    if memory.budget < manifest.file_bytes - embed_bytes(manifest):
        return None, f"{memory}: the layers and the LM head would stream"
    copies = 0 if config.plan == "ar" else _copies_cap(config)
    return PlainPlan(memory, memory.budget >= manifest.file_bytes, copies), ""


# parsing a tokenizer.json peaks this many times its size above the process before it:
# Qwen2.5's 10.9 MB 179 MiB (16.4x, 45 MiB kept), with room for another vocabulary's shape
PARSE_PEAK_PER_FILE_BYTE = 20


def tokenizer_peak_bytes(tokenizer_json: Path) -> int:
    """What parsing `tokenizer_json` adds to the process at its peak, by its size."""
    return PARSE_PEAK_PER_FILE_BYTE * tokenizer_json.stat().st_size


def _copies_cap(config: EngineConfig) -> int:
    """The copies a pass may verify: `--tree lookup:CAP`'s cap, else the plain path's."""
    return config.tree.cap if config.tree.kind == "lookup" else plain_copies.CAP


def plain_context(config: EngineConfig, manifest: Manifest) -> Context:
    """Once the target is in: the context a request may fill (ctx_size, else what the memory
    left holds, at most the model's)."""
    reading = read_process()
    kv_bytes = position_bytes(manifest.args, DTYPE_SIZES[manifest.dtype])
    args = manifest.args
    held = reading.process + reading.libraries
    return plan_context(config.ctx_size, args.max_seq_len, kv_bytes, reading.limit, held)


def _integer_matrices(manifest: Manifest) -> bool:
    return any(t.format in ("int4", "int8") for e in manifest.extents for t in e.tensors)
