"""What to benchmark, as plain data: options, and one ModeSpec per mode that either this
process or a child process (bench/child.py) turns into a running Mode."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import msgspec

from lever_actors.bench.results import ModeInfo
from lever_actors.config import EngineConfig
from lever_actors.device.layout import DTYPE_NAMES, MANIFEST_NAME, Manifest, read_manifest
from lever_actors.errors import ConfigError

ENGINE_FAMILIES = (
    "flash-ar",
    "sd-chain",
    "sd-static",
    "lever",
    "lever-no-gaincost",
    "lever-no-prune",
    "lever-no-ahead",
    "lever-eager",
    "lever-single-unit",
)
PEER_FAMILIES = ("peer-memory", "peer-offload", "peer-assisted")
MODES = ("memory-ar", *ENGINE_FAMILIES, *PEER_FAMILIES)
MEMORY_RESIDENT = ("memory-ar", "peer-memory")
ISOLATE = ("none", "peers", "all")
NEEDS_DRAFT = tuple(f for f in (*ENGINE_FAMILIES, "peer-assisted") if f != "flash-ar")


class BenchOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a bench run is asked to do, recorded in its results."""

    modes: tuple[str, ...] = ("memory-ar", "flash-ar")  # the first is the agreement reference
    budgets: tuple[str, ...] = ("25%",)  # DRAM budgets of flash modes; the first is headline
    throttle: str = "none"
    chain: tuple[int, ...] = (4,)
    static_tree: str = "4,2,2,1"
    prune_threshold: float | None = None  # for the Lever modes; None: the engine's default
    draft_dtype: str = "bfloat16"
    dtype: str | None = None  # compute dtype of memory-resident modes (default: the layout's)
    prompt_sets: tuple[str, ...] = ("humaneval",)
    prompts: int = 5
    max_new_tokens: int = 64
    seed: int = 0
    # none; all: each mode in a child process, under a memory cgroup where possible; peers:
    # only the transformers peers (whose offload reads go through the page cache), so that
    # ours, whose reads bypass it, can run interleaved in this process beside them
    isolate: str = "none"
    order: str = "interleaved"  # or "sequential": one mode at a time, over all prompts
    memory_limit: str | None = None  # one limit for every child; default: budget + draft + overhead
    memory_overhead: str = "1GiB"  # runtime headroom in the default limit
    cache_dir: str = ""  # where the peer's HF exports and offload folders go

    def isolates(self, family: str) -> bool:
        """Whether modes of this family run in a child process of their own."""
        return self.isolate == "all" or (self.isolate == "peers" and family in PEER_FAMILIES)

    def as_config(self) -> dict[str, object]:
        """As the results file records it (JSON types: lists, not tuples)."""
        return msgspec.json.decode(msgspec.json.encode(self))

    def validate(self) -> None:
        unknown = sorted(set(self.modes) - set(MODES))
        if unknown:
            raise ConfigError(
                f"unknown bench mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}"
            )
        if not self.modes:
            raise ConfigError("no modes to run")
        if self.isolate not in ISOLATE:
            raise ConfigError(f"isolate must be one of {', '.join(ISOLATE)}")
        if self.order not in ("interleaved", "sequential"):
            raise ConfigError("order must be interleaved or sequential")
        if self.max_new_tokens < 2:
            raise ConfigError("--max-new-tokens must be at least 2 (decode rate needs two tokens)")
        if self.prompts < 1:
            raise ConfigError("--prompts must be at least 1")


class MemoryARSpec(msgspec.Struct, frozen=True, tag="memory-ar"):
    target: str
    dtype: str


class EngineSpec(msgspec.Struct, frozen=True, tag="engine"):
    config: EngineConfig


class PeerSpec(msgspec.Struct, frozen=True, tag="peer"):
    model: str  # HF directory or .gguf file
    dtype: str
    max_memory_bytes: int | None = None
    offload_folder: str | None = None
    assistant: str | None = None
    assistant_dtype: str | None = None
    evict: tuple[str, ...] = ()


ModeSpec = MemoryARSpec | EngineSpec | PeerSpec


class PlannedMode(msgspec.Struct, frozen=True):
    info: ModeInfo
    spec: ModeSpec


def engine_variants(options: BenchOptions, family: str) -> list[tuple[str, str | None, dict]]:
    """(mode name, tree, EngineConfig fields) for an engine family. Conventional SD runs with
    the pruner and the gain-cost policy off; the Lever ablations turn one policy off each."""
    conventional = {"early_exit": "off", "projection": "on_demand", "units": "single"}
    static = f"static:{options.static_tree}"
    lever = {} if options.prune_threshold is None else {"prune_threshold": options.prune_threshold}
    variants = {
        "flash-ar": [("flash-ar", None, {"tree": "none", "early_exit": "off"})],
        "sd-chain": [
            (f"sd-chain:{k}", f"chain:{k}", {"tree": f"chain:{k}", **conventional})
            for k in options.chain
        ],
        "sd-static": [(f"sd-{static}", static, {"tree": static, **conventional})],
        "lever": [("lever", "gaincost", {**lever})],
        "lever-no-gaincost": [("lever-no-gaincost", static, {**lever, "tree": static})],
        "lever-no-prune": [("lever-no-prune", "gaincost", {"early_exit": "off"})],
        "lever-no-ahead": [("lever-no-ahead", "gaincost", {**lever, "draft_ahead": False})],
        "lever-eager": [("lever-eager", "gaincost", {**lever, "projection": "eager"})],
        "lever-single-unit": [("lever-single-unit", "gaincost", {**lever, "units": "single"})],
    }
    return variants[family]


def plan_modes(
    options: BenchOptions,
    target: Path,
    draft: Path | None,
    *,
    isolation_usable: bool = False,
) -> list[PlannedMode]:
    """One PlannedMode per mode and budget, in the order asked. The peer's HF exports of the
    target and draft are made here, once, into the cache."""
    from lever_actors.device.budget import parse_bytes, resolve_budget

    options.validate()
    manifest = read_manifest(target) if (target / MANIFEST_NAME).is_file() else None
    flash_modes = [m for m in options.modes if m not in MEMORY_RESIDENT]
    if manifest is None and flash_modes:
        raise ConfigError(
            f"modes {', '.join(flash_modes)} need a flash layout; {target} is not one"
        )
    if draft is None and set(options.modes) & set(NEEDS_DRAFT):
        raise ConfigError("speculative modes need a draft model")
    dtype = options.dtype or (manifest.dtype if manifest else None)
    if dtype is None:
        raise ConfigError("a compute dtype is needed when the target is not a flash layout")
    cache = Path(options.cache_dir) if options.cache_dir else target.parent
    full_bytes = manifest.file_bytes if manifest else weight_bytes(target, dtype)
    draft_bytes = weight_bytes(draft, options.draft_dtype) if draft is not None else 0
    overhead = parse_bytes(options.memory_overhead)

    def limit(family: str, budget_bytes: int) -> int | None:
        if not options.isolates(family):
            return None
        if options.memory_limit is not None:
            return parse_bytes(options.memory_limit)
        return budget_bytes + draft_bytes + overhead

    planned = []
    for family in options.modes:
        if family in MEMORY_RESIDENT:
            info = ModeInfo(
                name=family,
                family=family,
                budget_bytes=full_bytes,
                memory_limit_bytes=limit(family, full_bytes),
                isolated=options.isolates(family),
            )
            if family == "memory-ar":
                spec: ModeSpec = MemoryARSpec(str(target), dtype)
            else:
                model = _peer_export(target, manifest, cache) if manifest else target
                spec = PeerSpec(str(model), dtype)
            planned.append(PlannedMode(info, spec))
        elif family in ("peer-offload", "peer-assisted"):
            assert manifest is not None
            export = _peer_export(target, manifest, cache)
            assistant = None
            if family == "peer-assisted":
                assert draft is not None
                assistant = hf_export_for(draft, options.draft_dtype, cache)
            for label in options.budgets:
                budget = resolve_budget(label, manifest.file_bytes)
                name = f"{family}@{label}"
                offload = cache / "peer-offload" / f"{export.name}-{name.replace('%', 'pct')}"
                info = ModeInfo(
                    name=name,
                    family=family,
                    tree="assisted" if assistant else None,
                    budget=label,
                    budget_bytes=budget,
                    memory_limit_bytes=limit(family, budget),
                    isolated=options.isolates(family),
                )
                spec = PeerSpec(
                    str(export),
                    manifest.dtype,
                    max_memory_bytes=budget,
                    offload_folder=str(offload),
                    assistant=str(assistant) if assistant else None,
                    assistant_dtype=options.draft_dtype if assistant else None,
                    evict=(str(export), str(offload)),
                )
                planned.append(PlannedMode(info, spec))
        else:
            assert manifest is not None
            for name, tree, fields in engine_variants(options, family):
                for label in options.budgets:
                    budget = resolve_budget(label, manifest.file_bytes)
                    config = EngineConfig(
                        target=str(target),
                        draft=str(draft) if tree is not None and draft is not None else None,
                        throttle=options.throttle,
                        dram_budget=label,
                        draft_dtype=options.draft_dtype,
                        **fields,
                    )
                    info = ModeInfo(
                        name=f"{name}@{label}",
                        family=family,
                        tree=tree,
                        budget=label,
                        budget_bytes=budget,
                        throttle=options.throttle,
                        memory_limit_bytes=limit(family, budget),
                        isolated=options.isolates(family),
                    )
                    planned.append(PlannedMode(info, EngineSpec(config)))
    return planned


def open_in_process(planned: PlannedMode, drafts: dict | None = None):
    """The Mode of a spec, to run in this process; engine modes share drafts through `drafts`
    ((path, dtype) -> loaded draft)."""
    from lever_actors.bench.modes import EngineMode, MemoryAR
    from lever_actors.bench.peer import PeerHF

    spec, info = planned.spec, planned.info
    if isinstance(spec, MemoryARSpec):
        return MemoryAR(info, spec.target, spec.dtype)
    if isinstance(spec, EngineSpec):
        draft = None
        config = spec.config
        if config.draft is not None and drafts is not None:
            from lever_actors.draft import load_draft

            key = (config.draft, config.draft_dtype)
            if key not in drafts:
                drafts[key] = load_draft(config.draft, config.draft_dtype)
            draft = drafts[key]
        return EngineMode(info, config, draft)
    return PeerHF(
        info,
        spec.model,
        spec.dtype,
        max_memory_bytes=spec.max_memory_bytes,
        offload_folder=spec.offload_folder,
        assistant=spec.assistant,
        assistant_dtype=spec.assistant_dtype,
        evict=spec.evict,
    )


def hf_export_for(path: Path, dtype: str, cache: Path) -> Path:
    """An HF directory with the weights of `path` as `dtype`: `path` itself when it is one,
    else an export made once beside a flash layout or into `cache` for a GGUF file."""
    from lever_actors.checkpoints.export import export_hf
    from lever_actors.progress import ProgressLine

    if path.is_dir() and not (path / MANIFEST_NAME).is_file():
        return path  # already an HF directory
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}[dtype]
    parent = path.parent if path.is_dir() else cache
    out = parent / f"{path.stem if path.is_file() else path.name}.hf-{short}"
    if not (out / "config.json").is_file():
        print(
            f"exporting {path.name} as an HF directory for the peer (once): {out}", file=sys.stderr
        )
        export_hf(path, out, DTYPE_NAMES[dtype], progress=ProgressLine(sys.stderr))
    return out


def _peer_export(target: Path, manifest: Manifest, cache: Path) -> Path:
    return hf_export_for(target, manifest.dtype, cache)


def weight_bytes(path: Path, dtype: str) -> int:
    """Bytes the weights of checkpoint `path` take as `dtype`, read from metadata only."""
    itemsize = DTYPE_NAMES[dtype].itemsize
    return weight_elements(path) * itemsize


def weight_elements(path: Path) -> int:
    if (path / MANIFEST_NAME).is_file():
        return sum(math.prod(t.shape) for e in read_manifest(path).extents for t in e.tensors)
    if path.is_dir():
        return sum(_safetensors_elements(f) for f in sorted(path.glob("*.safetensors")))
    if path.suffix == ".gguf":
        import gguf

        return sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors)
    raise ConfigError(f"{path}: cannot tell the size of its weights")


def _safetensors_elements(path: Path) -> int:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
