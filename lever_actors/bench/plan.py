"""What to benchmark: the options of a run, the planned modes they make (one per mode and
budget, as plain data that a child process can receive), and a planned mode opened in this
process."""

from __future__ import annotations

import functools
import json
import math
import struct
from pathlib import Path
from typing import Any, Literal

import gguf
import msgspec

from lever_actors.bench import llamacpp_build
from lever_actors.bench.llamacpp import DEFAULT_DRAFT_MAX, DEFAULT_THREADS, LlamaCppSpec
from lever_actors.bench.peer import hf_export_for
from lever_actors.bench.results import ModeInfo
from lever_actors.bench.specs import (
    EngineSpec,
    MemoryARSpec,
    ModeSpec,
    PeerSpec,
    PlainSpec,
    PlannedMode,
)
from lever_actors.bench.summary import LLAMACPP_FAMILIES, PLAIN_FAMILIES
from lever_actors.config import (
    DEFAULT_MAX_NEW_TOKENS,
    DRAFT_VOCABULARY,
    DraftDtype,
    DramBudget,
    EngineConfig,
    Throttle,
    TreeSpec,
)
from lever_actors.device.layout import DTYPE_NAMES
from lever_actors.device.manifest import MANIFEST_NAME, Manifest, read_manifest
from lever_actors.draft import load_draft
from lever_actors.errors import ConfigError
from lever_actors.model.sampling import GREEDY, Sampling
from lever_actors.paths import default_cache_dir
from lever_actors.sizes import compact_bytes, parse_bytes

# Lever with its decode plan forced rather than chosen: what auto's choice is judged against
FORCED_PLANS = ("lever-trees", "lever-lookup", "lever-ar")
ENGINE_FAMILIES = (
    "flash-ar",
    "sd-chain",
    "sd-static",
    "lever",
    "lever-no-gaincost",
    "lever-no-prune",
    "lever-draft-ahead",
    "lever-no-lookup",
    "lever-eager",
    "lever-two-units",
    "flash-ar-no-verify",
    "lever-no-verify",
    *FORCED_PLANS,
)
PEER_FAMILIES = ("peer-memory", "peer-offload", "peer-assisted")
# memory-ar-dense: memory-resident AR on the target's GGUF dequantized to bf16, beside the
# quantized layout's memory-ar
MEMORY_RESIDENT = ("memory-ar", "memory-ar-dense", "peer-memory")
MODES = (*MEMORY_RESIDENT, *ENGINE_FAMILIES, *PLAIN_FAMILIES, *PEER_FAMILIES, *LLAMACPP_FAMILIES)
ISOLATE = ("none", "peers", "all")
DRAFTLESS = ("flash-ar", "flash-ar-no-verify", "lever-lookup", "lever-ar", *PLAIN_FAMILIES)
NEEDS_DRAFT = tuple(
    f for f in (*ENGINE_FAMILIES, "peer-assisted", "llamacpp-spec") if f not in DRAFTLESS
)


class BenchOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a bench run is asked to do, recorded in its results; checked when made."""

    modes: tuple[str, ...] = ("memory-ar", "flash-ar")  # the first is the agreement reference
    # DRAM budgets of flash modes ("25%" and "1.5GiB" are read); the first is the headline
    budgets: tuple[DramBudget, ...] = (DramBudget.parse("25%"),)
    throttle: Throttle = "none"
    chain: tuple[int, ...] = (4,)
    static_tree: str = "4,2,2,1"
    prune_threshold: float | None = None  # for the Lever modes; None: the engine's default
    draft_dtype: DraftDtype = "bfloat16"
    dtype: str | None = None  # compute dtype of memory-resident modes (default: the layout's)
    prompt_sets: tuple[str, ...] = ("humaneval",)
    prompts: int = 5
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    seed: int = 0
    sampling: Sampling = GREEDY  # how every mode chooses tokens
    # none; all: each mode in a child process, under a memory cgroup where possible; peers:
    # only the transformers peers (whose offload reads go through the page cache), so that
    # ours, whose reads bypass it, can run interleaved in this process beside them
    isolate: str = "none"
    order: str = "interleaved"  # or "sequential": one mode at a time, over all prompts
    memory_limit: str | None = None  # one limit for every child; default: budget + draft + overhead
    memory_overhead: str = "1GiB"  # runtime headroom in the default limit
    # memory limits as the run's axis ("1GiB", ...): every mode but the memory-resident ones
    # runs under each, in a child (isolate "all"); ours plan their own DRAM budget under it
    # (dram_budget auto), Lever its decode plan too (plan auto); the budgets above are unused
    limits: tuple[str, ...] = ()
    # requests at once (bench/concurrency.py): under each limit, Lever's engine and
    # llama-server take each many at once, over the prompt sets' prompts mixed; () for none
    parallel: tuple[int, ...] = ()
    cache_dir: str = ""  # where the peer's HF exports and offload folders go
    # llama.cpp (bench/llamacpp.py): drafted tokens per step of llamacpp-spec, threads, a
    # directory holding its programs (default: the cache's build), and the GGUFs it runs
    # (default: the target's own GGUF, a layout's source, and the draft's)
    llamacpp_draft_max: int = DEFAULT_DRAFT_MAX
    llamacpp_threads: int = DEFAULT_THREADS
    llamacpp_bin: str | None = None
    llamacpp_target: str | None = None
    llamacpp_draft: str | None = None

    def __post_init__(self) -> None:
        # budgets may come as text ("25%", "1.5GiB"): parsed here, once
        budgets = tuple(
            b if isinstance(b, DramBudget) else DramBudget.parse(b) for b in self.budgets
        )
        msgspec.structs.force_setattr(self, "budgets", budgets)
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
        if self.llamacpp_draft_max < 1 or self.llamacpp_threads < 1:
            raise ConfigError("--llamacpp-draft-max and --llamacpp-threads must be at least 1")
        for limit in self.limits:
            parse_bytes(limit)  # a limit that cannot be read fails here, not mid-run
        if self.limits and (self.isolate != "all" or self.memory_limit is not None):
            raise ConfigError(
                "--limits runs every mode in a child under each limit: it needs --isolate all "
                "and no --memory-limit"
            )
        if self.parallel:
            self._check_parallel()

    def _check_parallel(self) -> None:
        pool = self.prompts * len(self.prompt_sets)
        if 1 not in self.parallel:
            raise ConfigError(
                "--parallel needs 1 among its counts: each request is compared with its "
                "sequential run, and the aggregates with one request's"
            )
        if max(self.parallel) > pool or min(self.parallel) < 1:
            raise ConfigError(
                f"--parallel {max(self.parallel)} needs as many different prompts: "
                f"--prompts {self.prompts} over {len(self.prompt_sets)} prompt set(s) gives {pool}"
            )
        if not self.limits:
            raise ConfigError("--parallel runs under memory limits: give --limits")
        if not self.sampling.greedy:
            raise ConfigError("--parallel decodes greedily, as llama-server is driven")

    def isolates(self, family: str) -> bool:
        """Whether modes of this family run in a process of their own: a child, or for
        llama.cpp its own program (whose reads, like the transformers peers', go through
        the page cache)."""
        peers = (*PEER_FAMILIES, *LLAMACPP_FAMILIES)
        return self.isolate == "all" or (self.isolate == "peers" and family in peers)

    def as_config(self) -> dict[str, object]:
        """As the results file records it: JSON types, the budgets as text."""
        recorded = msgspec.json.decode(msgspec.json.encode(self))
        return recorded | {"budgets": [str(b) for b in self.budgets]}


def engine_variants(options: BenchOptions, family: str) -> list[tuple[str, str | None, dict]]:
    """(mode name, tree, EngineConfig fields) for an engine family. Conventional SD runs with
    the pruner and the gain-cost policy off; the Lever ablations turn one policy off each."""
    conventional = {"early_exit": "off", "projection": "on_demand", "units": "single"}
    static = f"static:{options.static_tree}"
    lever = {} if options.prune_threshold is None else {"prune_threshold": options.prune_threshold}
    variants: dict[str, list[tuple[str, str | None, dict]]] = {
        "flash-ar": [("flash-ar", None, {"tree": "none", "early_exit": "off"})],
        "sd-chain": [
            (f"sd-chain:{k}", f"chain:{k}", {"tree": f"chain:{k}", **conventional})
            for k in options.chain
        ],
        "sd-static": [(f"sd-{static}", static, {"tree": static, **conventional})],
        "lever": [("lever", "gaincost", {**lever})],
        "lever-no-gaincost": [("lever-no-gaincost", static, {**lever, "tree": static})],
        "lever-no-prune": [("lever-no-prune", "gaincost", {"early_exit": "off"})],
        "lever-draft-ahead": [("lever-draft-ahead", "gaincost", {**lever, "draft_ahead": True})],
        "lever-no-lookup": [("lever-no-lookup", "gaincost", {**lever, "lookup": False})],
        "lever-eager": [("lever-eager", "gaincost", {**lever, "projection": "eager"})],
        "lever-two-units": [("lever-two-units", "gaincost", {**lever, "units": "split"})],
        # the price of checking every flash read
        "flash-ar-no-verify": [
            (
                "flash-ar-no-verify",
                None,
                {"tree": "none", "early_exit": "off", "verify_checksums": False},
            )
        ],
        "lever-no-verify": [("lever-no-verify", "gaincost", {**lever, "verify_checksums": False})],
        "lever-trees": [("lever-trees", "gaincost", {**lever, "plan": "trees"})],
        "lever-lookup": [("lever-lookup", "lookup", {"plan": "lookup"})],
        "lever-ar": [("lever-ar", None, {"plan": "ar"})],
    }
    return variants[family]


def plan_modes(options: BenchOptions, target: Path, draft: Path | None) -> list[PlannedMode]:
    """One PlannedMode per mode and budget, in the order asked. The peer's HF exports of the
    target and draft are made here, once, into the cache."""
    manifest = read_manifest(target) if (target / MANIFEST_NAME).is_file() else None
    flash_modes = [m for m in options.modes if m not in (*MEMORY_RESIDENT, *LLAMACPP_FAMILIES)]
    if manifest is None and flash_modes:
        raise ConfigError(
            f"modes {', '.join(flash_modes)} need a flash layout; {target} is not one"
        )
    needs_draft = set(options.modes) & set(NEEDS_DRAFT)
    if options.llamacpp_draft:
        needs_draft.discard("llamacpp-spec")  # it has its own
    if draft is None and needs_draft:
        raise ConfigError("speculative modes need a draft model")
    dtype = options.dtype or (manifest.dtype if manifest else None)
    ours = [m for m in options.modes if m not in LLAMACPP_FAMILIES]
    if dtype is None and ours:
        raise ConfigError("a compute dtype is needed when the target is not a flash layout")

    @functools.cache
    def draft_bytes() -> int:
        """The draft's DRAM, loaded to measure it (seconds for the real draft): only where a
        memory limit needs it, never for modes that run in this process."""
        return draft_dram_bytes(draft, options.draft_dtype) if draft is not None else 0

    if options.limits:
        return _plan_under_limits(options, target, draft, manifest, dtype)
    cache = Path(options.cache_dir) if options.cache_dir else target.parent
    full_bytes = 0
    if ours:
        assert dtype is not None  # checked above
        full_bytes = manifest.file_bytes if manifest else weight_bytes(target, dtype)
    overhead = parse_bytes(options.memory_overhead)
    one_limit = None if options.memory_limit is None else parse_bytes(options.memory_limit)

    def held(family: str, budget_bytes: int, extra_bytes: int | None = None) -> dict[str, Any]:
        """A mode's memory facts; an isolated one gets a memory limit: the one asked for,
        else its budget + the draft's weights (or `extra_bytes`) + the overhead."""
        isolated, limit = options.isolates(family), None
        if isolated:
            extra = draft_bytes() if extra_bytes is None else extra_bytes
            limit = budget_bytes + extra + overhead if one_limit is None else one_limit
        return {"budget_bytes": budget_bytes, "memory_limit_bytes": limit, "isolated": isolated}

    def info(
        name: str, family: str, budget_bytes: int, extra_bytes: int | None = None, **fields
    ) -> ModeInfo:
        return ModeInfo(
            name=name, family=family, **held(family, budget_bytes, extra_bytes), **fields
        )

    planned = []
    for family in options.modes:
        if family in MEMORY_RESIDENT:
            spec = _memory_resident(family, target, manifest, dtype, cache)
            planned.append(PlannedMode(info(family, family, full_bytes), spec))
        elif family in PLAIN_FAMILIES:  # it plans its own memory: the whole target, or nothing
            assert manifest is not None
            planned.append(
                PlannedMode(info(family, family, full_bytes, 0), _plain_spec(target, family))
            )
        elif family in LLAMACPP_FAMILIES:
            spec = plan_llamacpp(options, family, target, draft)
            model_bytes = _size(spec.model)
            draft_file_bytes = _size(spec.draft) if spec.draft else 0
            tree = _llamacpp_tree(options, spec)
            mode = info(family, family, model_bytes, draft_file_bytes, tree=tree)
            planned.append(PlannedMode(mode, spec))
        elif family in ("peer-offload", "peer-assisted"):
            assert manifest is not None
            export = hf_export_for(target, manifest.dtype, cache)
            assistant = None
            if family == "peer-assisted":
                assert draft is not None
                assistant = hf_export_for(draft, options.draft_dtype, cache)
            for budget in options.budgets:
                name = f"{family}@{budget}"
                offload = cache / "peer-offload" / f"{export.name}-{name.replace('%', 'pct')}"
                budget_bytes = budget.bytes_of(manifest.file_bytes)
                spec = PeerSpec(
                    str(export),
                    manifest.dtype,
                    max_memory_bytes=budget_bytes,
                    offload_folder=str(offload),
                    assistant=str(assistant) if assistant else None,
                    assistant_dtype=options.draft_dtype if assistant else None,
                    evict=(str(export), str(offload)),
                )
                tree = "assisted" if assistant else None
                mode = info(name, family, budget_bytes, tree=tree, budget=str(budget))
                planned.append(PlannedMode(mode, spec))
        else:
            assert manifest is not None
            for variant in engine_variants(options, family):
                for budget in options.budgets:
                    facts = held(family, budget.bytes_of(manifest.file_bytes))
                    planned.append(
                        _engine_mode(options, target, draft, family, variant, budget, facts)
                    )
    return planned


def _plan_under_limits(
    options: BenchOptions,
    target: Path,
    draft: Path | None,
    manifest: Manifest | None,
    dtype: str | None,
) -> list[PlannedMode]:
    """--limits: the memory-resident modes once, without a limit; every other mode once per
    limit, in a child under it, named `mode@limit`. Ours plan the target's DRAM budget
    themselves, at start, under the limit they find (dram_budget auto: plan/memory.py), and
    Lever its decode plan too (plan auto); the budget each planned comes back from its child
    (ModeInfo.budget_bytes)."""
    cache = Path(options.cache_dir) if options.cache_dir else target.parent
    auto = DramBudget.parse("auto")
    planned = []
    for family in options.modes:
        if family not in MEMORY_RESIDENT:
            continue
        spec = _memory_resident(family, target, manifest, dtype, cache)
        full = manifest.file_bytes if manifest and family == "memory-ar" else None
        mode = ModeInfo(name=family, family=family, budget_bytes=full, isolated=True)
        planned.append(PlannedMode(mode, spec))
    for text in options.limits:
        limit = parse_bytes(text)
        label = compact_bytes(limit)
        under: dict[str, Any] = {"memory_limit_bytes": limit, "limit": label, "isolated": True}
        for family in options.modes:
            if family in MEMORY_RESIDENT:
                continue
            if family in LLAMACPP_FAMILIES:
                spec = plan_llamacpp(options, family, target, draft)
                tree = _llamacpp_tree(options, spec)
                mode = ModeInfo(name=f"{family}@{label}", family=family, tree=tree, **under)
                planned.append(PlannedMode(mode, spec))
                continue
            if family in PEER_FAMILIES:
                raise ConfigError(f"--limits does not run the transformers peer {family}")
            if family in PLAIN_FAMILIES:
                mode = ModeInfo(name=f"{family}@{label}", family=family, **under)
                planned.append(PlannedMode(mode, _plain_spec(target, family)))
                continue
            assert manifest is not None
            for name, tree, fields in engine_variants(options, family):
                chosen = {"plan": "auto"} if family == "lever" else {}  # ablations keep theirs
                variant = (name, tree, fields | chosen)
                planned.append(_engine_mode(options, target, draft, family, variant, auto, under))
    return planned


def _plain_spec(target: Path, family: str) -> PlainSpec:
    """The plain path on `target`'s layout, planning its memory as `generate --plan ar` (or
    `lookup`, for lever-plain-lookup) does."""
    plan: Literal["ar", "lookup"] = "lookup" if family == "lever-plain-lookup" else "ar"
    return PlainSpec(EngineConfig(target=str(target), draft=None, plan=plan))


def _memory_resident(
    family: str, target: Path, manifest: Manifest | None, dtype: str | None, cache: Path
) -> ModeSpec:
    assert dtype is not None  # plan_modes checked our modes have one
    if family == "memory-ar":
        return MemoryARSpec(str(target), dtype)
    if family == "memory-ar-dense":
        source = gguf_of(target)
        if source is None:
            raise ConfigError(f"memory-ar-dense needs the GGUF the target {target} came from")
        return MemoryARSpec(str(source), "bfloat16")  # a GGUF loads dense unless asked
    model = hf_export_for(target, manifest.dtype, cache) if manifest else target
    return PeerSpec(str(model), dtype)


def _engine_mode(
    options: BenchOptions,
    target: Path,
    draft: Path | None,
    family: str,
    variant: tuple[str, str | None, dict],
    budget: DramBudget,
    facts: dict[str, Any],
) -> PlannedMode:
    """An engine variant (engine_variants) at `budget`, named `variant@limit` where `facts`
    (the rest of its ModeInfo) give a limit, else `variant@budget`."""
    name, tree, fields = variant
    config = _engine_config(options, target, draft, tree, budget, fields)
    at = facts.get("limit") or budget
    mode = ModeInfo(
        name=f"{name}@{at}",
        family=family,
        tree=tree,
        budget=str(budget),
        throttle=options.throttle,
        **facts,
    )
    return PlannedMode(mode, EngineSpec(config))


def _engine_config(
    options: BenchOptions,
    target: Path,
    draft: Path | None,
    tree: str | None,
    budget: DramBudget,
    fields: dict,
) -> EngineConfig:
    return EngineConfig(
        target=str(target),
        draft=str(draft) if _drafts_from(tree) and draft is not None else None,
        throttle=options.throttle,
        dram_budget=budget,
        draft_dtype=options.draft_dtype,
        **fields,
    )


def _drafts_from(tree: str | None) -> bool:
    """Whether a variant's tree is proposed by a draft model (not copies of the text)."""
    return tree is not None and TreeSpec.parse(tree).needs_draft


def _llamacpp_tree(options: BenchOptions, spec: LlamaCppSpec) -> str | None:
    return f"draft-simple:{options.llamacpp_draft_max}" if spec.draft else None


def draft_dram_bytes(path: Path, dtype: str) -> int:
    """Bytes the engine's draft holds in DRAM, measured on the draft loaded as the engine
    loads it (a GGUF's classes are rewritten for the kernels: the real draft holds 378 MB
    of its 491 MB file)."""
    return load_draft(str(path), dtype, vocabulary=DRAFT_VOCABULARY).dram_bytes


def plan_llamacpp(
    options: BenchOptions,
    family: str,
    target: Path,
    draft: Path | None,
    program_name: str | None = None,
) -> LlamaCppSpec:
    """What a llama.cpp mode runs: its program (from --llamacpp-bin, else the cache's
    build) and the GGUFs; `program_name` names another of the build's programs for the same
    GGUFs (llama-server: the draft's with llamacpp-spec). What is missing makes the spec
    `unavailable`, with the reason: the mode's rows then say so and the rest of the run
    goes on."""
    cache = Path(options.cache_dir) if options.cache_dir else default_cache_dir()
    name = program_name or (
        llamacpp_build.COMPLETION if family == "llamacpp-ar" else llamacpp_build.SPECULATIVE
    )
    unavailable = None
    if options.llamacpp_bin:
        program = Path(options.llamacpp_bin) / name
        if not program.is_file():
            unavailable = f"no {name} in {options.llamacpp_bin} (--llamacpp-bin)"
    else:
        build = llamacpp_build.find_build(cache)
        program = build.program(name) if build else Path()
        if build is None:
            unavailable = llamacpp_build.why_unavailable(cache)
    model = Path(options.llamacpp_target) if options.llamacpp_target else gguf_of(target)
    if model is None and unavailable is None:
        unavailable = f"no GGUF of the target {target} for llama.cpp; give --llamacpp-target"
    draft_gguf = None
    if family == "llamacpp-spec":
        draft_gguf = Path(options.llamacpp_draft) if options.llamacpp_draft else gguf_of(draft)
        if draft_gguf is None and unavailable is None:
            unavailable = f"no GGUF of the draft {draft} for llama.cpp; give --llamacpp-draft"
    return LlamaCppSpec(
        program=str(program) if unavailable is None else "",
        model=str(model or ""),
        tokenizer=str(target),
        prompt_dir=str(cache / "llama.cpp-prompts"),
        draft=str(draft_gguf) if draft_gguf else None,
        draft_max=options.llamacpp_draft_max,
        threads=options.llamacpp_threads,
        unavailable=unavailable,
    )


def gguf_of(path: Path | None) -> Path | None:
    """`path` if it is a GGUF file, else the GGUF a flash layout was converted from if it is
    still there; None otherwise."""
    if path is None:
        return None
    if path.suffix == ".gguf" and path.is_file():
        return path
    if (path / MANIFEST_NAME).is_file():
        source = Path(read_manifest(path).source)
        if source.suffix == ".gguf" and source.is_file():
            return source
    return None


def _size(path: str) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0


def weight_bytes(path: Path, dtype: str) -> int:
    """Bytes the weights of checkpoint `path` take as `dtype`, read from metadata only."""
    return weight_elements(path) * DTYPE_NAMES[dtype].itemsize


def weight_elements(path: Path) -> int:
    if (path / MANIFEST_NAME).is_file():
        return sum(math.prod(t.shape) for e in read_manifest(path).extents for t in e.tensors)
    if path.is_dir():
        return sum(_safetensors_elements(f) for f in sorted(path.glob("*.safetensors")))
    if path.suffix == ".gguf":
        return sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors)
    raise ConfigError(f"{path}: cannot tell the size of its weights")


def _safetensors_elements(path: Path) -> int:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
