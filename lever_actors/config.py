"""Engine configuration: typed msgspec Structs, parsed and checked once, when constructed.

A field whose values form a set is a `Literal`, a bounded number carries `msgspec.Meta`
bounds, and msgspec checks both; the tree shape and the DRAM budget may be given as text
("chain:4", "25%") and are parsed into their types on construction. A bad value raises
ConfigError naming the field, before anything is loaded.
"""

from __future__ import annotations

import math
import re
import typing
from typing import Annotated, Literal

import msgspec

from lever_actors.errors import ConfigError, ContextLengthError
from lever_actors.sizes import compact_bytes, parse_bytes

DEFAULT_GAINCOST_CAP = 64
MAX_TREE_NODES = 1024  # draft nodes one tree may have: a pass verifies them all at once
MAX_STATIC_WIDTH = 64  # children per node a static tree may ask for
DEFAULT_MAX_NEW_TOKENS = 128
# finished requests' KV kept for later ones: the real pair's 40 KiB a token, about 6,500 tokens
DEFAULT_PROMPT_CACHE = 256 * 2**20
SPILLED_PROMPT_CACHE = 4 * 2**30  # the prompt cache's directory holds at most this

# auto: trained where one is saved, else lens; probe_only: probes sent, nothing pruned (a
# probe's cost without its gain); off: no probes
EarlyExit = Literal["auto", "lens", "trained", "probe_only", "off"]
PruneWhen = Literal["compute_bound", "always"]
Projection = Literal["on_demand", "eager"]
Units = Literal["single", "split"]
DraftDtype = Literal["bfloat16", "float32", "float64"]
# matrices: dense, auto (a GGUF's own precision class), or quantized to 4 bits (int4, or q4k:
# Q4_K's values), 6 (q6k: Q6_K's) or 8
Weights = Literal["dense", "auto", "q4", "q4k", "q6", "q8"]
WEIGHTS_CHOICES: tuple[str, ...] = typing.get_args(Weights)
Throttle = Literal["none", "ufs3.1", "ufs4.0"]
# how tokens are proposed: trees (a draft model's gain-cost trees), lookup (copies from the
# text alone: no draft model in memory), ar (one token a pass); auto: the one the cost model
# predicts fastest for the memory there is (plan/decode.py)
Plan = Literal["auto", "trees", "lookup", "ar"]


def default_exit_layer(n_layers: int) -> int:
    """7/8 of the way through: measured on Qwen2.5-Coder-1.5B, the logit lens at the middle
    layer ranks the target's own next token first only 17% of the time, at 7/8 about 70%."""
    return n_layers * 7 // 8


def check_max_new_tokens(n: int) -> int:
    if n <= 0:
        raise ConfigError(f"max_new_tokens must be positive, got {n}")
    return n


def check_prompt(length: int) -> None:
    """A request must have a prompt: `length` counts its tokens, or its characters where it
    is checked before a tokenizer has loaded."""
    if length == 0:
        raise ConfigError("the prompt is empty")


def check_request_size(
    prompt_tokens: int, max_new_tokens: int, context: int, why: str = "the model's"
) -> None:
    """A request must have a prompt, and it and its new tokens must fit the context (`why`
    says where its size comes from)."""
    check_prompt(prompt_tokens)
    check_max_new_tokens(max_new_tokens)
    if prompt_tokens + max_new_tokens > context:
        raise ContextLengthError(
            f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"the context of {context} tokens ({why})",
            prompt_tokens,
            context,
        )


def _check_fields(struct: msgspec.Struct, prefix: str = "") -> None:
    """msgspec's own checks of every field's type, Literal and bounds, as a ConfigError."""
    hints = typing.get_type_hints(type(struct), include_extras=True)
    for name in struct.__struct_fields__:
        value = getattr(struct, name)
        try:
            msgspec.convert(value, hints[name], strict=True)
        except msgspec.ValidationError as e:
            choices = typing.get_args(hints[name]) if _is_literal(hints[name]) else ()
            reason = f"expected one of {', '.join(choices)}" if choices else str(e).lower()
            raise ConfigError(f"{prefix}{name} = {value!r}: {reason}") from None


def _is_literal(hint: object) -> bool:
    return typing.get_origin(hint) is Literal


class TreeSpec(msgspec.Struct, frozen=True):
    """Shape policy of the draft tree.

    none: no drafting (autoregressive); chain: k greedy tokens; static: at depth d every node
    takes its top widths[d] children (SpecInfer/Sequoia style); gaincost: Lever's best-first
    tree sized by expected tokens per second of predicted step time, up to `cap` nodes;
    lookup: no draft model, a chain of tokens copied from the committed text (prompt lookup),
    as long as the same objective pays for, up to `cap`.
    """

    kind: Literal["none", "chain", "static", "gaincost", "lookup"]
    widths: tuple[int, ...] = ()  # chain: (1,)*k
    cap: int = 0  # gaincost, lookup: most draft nodes

    @classmethod
    def parse(cls, text: str) -> TreeSpec:
        """'none', 'chain:4', 'static:3,2,1', 'gaincost[:CAP]' or 'lookup[:CAP]'."""
        text = text.strip()
        if text == "none":
            return cls("none")
        capped = re.fullmatch(r"(gaincost|lookup)(?::(\d+))?", text)
        if capped:
            cap = int(capped.group(2) or DEFAULT_GAINCOST_CAP)
            if cap < 1:
                raise ConfigError(f"tree {text!r}: the cap must be at least 1")
            kind: Literal["gaincost", "lookup"] = (
                "lookup" if capped.group(1) == "lookup" else "gaincost"
            )
            return cls(kind, cap=cap).checked(text)
        match = re.fullmatch(r"(chain|static):(\d+(?:,\d+)*)", text)
        if not match:
            raise ConfigError(
                f"cannot read tree {text!r}; use none, chain:K, static:W1,W2,..., "
                "gaincost[:CAP] or lookup[:CAP]"
            )
        numbers = tuple(int(n) for n in match.group(2).split(","))
        if any(n < 1 for n in numbers):
            raise ConfigError(f"tree {text!r}: every size must be at least 1")
        if match.group(1) == "chain":
            if len(numbers) != 1:
                raise ConfigError(f"tree {text!r}: chain takes one length, e.g. chain:4")
            _check_tree_nodes(text, numbers[0])  # before a tuple of that length is built
            return cls("chain", (1,) * numbers[0])
        spec = cls("static", numbers).checked(text)
        if max(numbers) > MAX_STATIC_WIDTH:
            raise ConfigError(
                f"tree {text!r}: a static width is at most {MAX_STATIC_WIDTH} (the draft "
                "candidates a node keeps)"
            )
        return spec

    def checked(self, text: str) -> TreeSpec:
        _check_tree_nodes(text, self.max_nodes)
        return self

    @property
    def needs_draft(self) -> bool:
        """Whether a draft model proposes this tree's nodes."""
        return self.kind in ("chain", "static", "gaincost")

    @property
    def sized_by_cost(self) -> bool:
        """Whether the cost model sizes this tree (gain-cost, and copies from the text)."""
        return self.kind in ("gaincost", "lookup")

    @property
    def max_nodes(self) -> int:
        if self.sized_by_cost:
            return self.cap
        total, level = 0, 1
        for width in self.widths:
            level *= width
            total += level
        return total

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "chain":
            return f"chain:{len(self.widths)}"
        if self.sized_by_cost:
            return f"{self.kind}:{self.cap}"
        return "static:" + ",".join(map(str, self.widths))


def _check_tree_nodes(text: str, nodes: int) -> None:
    if nodes > MAX_TREE_NODES:
        raise ConfigError(
            f"tree {text!r} has {nodes} draft nodes; at most {MAX_TREE_NODES}, since one "
            "pass verifies them all"
        )


class DramBudget(msgspec.Struct, frozen=True):
    """Target weights held in DRAM: what the memory this process may use leaves for them
    (auto, planned at start: plan/memory.py), all of them, a share of the layout's bytes,
    or a size."""

    kind: Literal["auto", "all", "share", "size"]
    value: float = 1.0  # share: a fraction (0.25 for 25%); size: bytes

    @classmethod
    def parse(cls, text: str | int) -> DramBudget:
        """'auto', 'all', '25%', '1.5GiB', '800MB' or a number of bytes."""
        if isinstance(text, int):
            budget = cls("size", float(text))
        elif text.strip() in ("auto", "all"):
            budget = cls(text.strip())  # type: ignore[arg-type]  # one of the kinds
        elif text.strip().endswith("%"):
            try:
                budget = cls("share", float(text.strip()[:-1]) / 100)
            except ValueError:
                raise ConfigError(f"cannot read {text!r} as a percentage") from None
        else:
            budget = cls("size", float(parse_bytes(text)))
        if not (math.isfinite(budget.value) and budget.value > 0):  # float() reads inf and nan
            raise ConfigError(f"dram_budget must be positive and finite, got {text!r}")
        if budget.kind == "share" and budget.value > 1:
            raise ConfigError(f"dram_budget {text!r}: a share is at most 100% (all)")
        return budget

    def bytes_of(self, model_bytes: int) -> int:
        """The budget in bytes for a model of `model_bytes`; auto has none before the
        engine plans it."""
        if self.kind == "auto":
            raise ConfigError("dram_budget auto is planned by the engine at start; give a size")
        if self.kind == "all":
            return model_bytes
        if self.kind == "share":
            return int(model_bytes * self.value)
        return int(self.value)

    def __str__(self) -> str:
        if self.kind in ("auto", "all"):
            return self.kind
        if self.kind == "share":
            return f"{self.value * 100:g}%"
        return compact_bytes(int(self.value))


class ChannelSizes(msgspec.Struct, frozen=True):
    """Capacity of the bounded channels between actors (the verifier's arrivals hold what
    the batch's requests may send at once: engine/crew.py; the layers, the ring's slots)."""

    requests: Annotated[int, msgspec.Meta(ge=1)] = 1
    probes: Annotated[int, msgspec.Meta(ge=1)] = 1
    prune_verdicts: Annotated[int, msgspec.Meta(ge=1)] = 1
    finals: Annotated[int, msgspec.Meta(ge=1)] = 1
    commits: Annotated[int, msgspec.Meta(ge=1)] = 1
    verdicts: Annotated[int, msgspec.Meta(ge=1)] = 1
    events: Annotated[int, msgspec.Meta(ge=1)] = 64  # tokens buffered for a slow consumer

    def __post_init__(self) -> None:
        _check_fields(self, "channel ")


# the tree of a config that names a draft and no tree (an EngineConfig's default)
DEFAULT_TREE = TreeSpec("gaincost", cap=DEFAULT_GAINCOST_CAP)
DRAFT_VOCABULARY = 65536  # the ids a draft proposes from by default (EngineConfig)
DRAFT_WINDOW = 256  # the prompt tokens a draft prefills at most, by default (EngineConfig)


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    target: str  # flash layout directory, or a GGUF file (converted once, on first use)
    draft: str | None = None  # HF directory, GGUF file or flash layout; held whole in DRAM
    # target weights in DRAM: auto (what the memory the process may use leaves beside the
    # draft and room for a context: plan/memory.py), all, a share ("25%") or a size
    dram_budget: DramBudget = DramBudget("auto")
    ring_slots: Annotated[int, msgspec.Meta(ge=2)] = 2  # one slot read while one computes
    # or "chain:4", "none", ...; left out: DEFAULT_TREE where a draft is named, else none
    tree: TreeSpec = DEFAULT_TREE
    # None: the tree (and draft) as given; else a plan (Plan), which sets the tree
    plan: Plan | None = None
    # testing: gain-cost trees try copies of the text after this many steps of a request,
    # and keep them for good, whatever the prices (an auto plan's switch, forced:
    # plan/switch.py); None: where auto chose trees, as the prices say
    switch_at: Annotated[int, msgspec.Meta(ge=0)] | None = None
    early_exit: EarlyExit = "auto"  # auto: trained if one is saved beside the target, else lens
    exit_layer: Annotated[int, msgspec.Meta(ge=0)] | None = None  # default: 7/8 of the target
    # drop a child scoring below this within its candidate set
    prune_threshold: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.02
    # compute_bound: with a cost model (gain-cost trees), prune only passes that compute,
    # not flash, paces, where the most pruning could save exceeds a probe's cost; always:
    # prune whenever a predictor is on
    prune_when: PruneWhen = "compute_bound"
    # every n-th step runs pruned nodes anyway, to count false prunes (0: never)
    audit_every: Annotated[int, msgspec.Meta(ge=0)] = 10
    # gain-cost: draft the next tree while flash paces this pass; off by default, since the
    # rounds took cores the pass needed and were rarely hit (docs/benchmarks.md)
    draft_ahead: bool = False
    # gain-cost: nodes not yet run also offer the token that followed their path's end in
    # the committed text, taken where it pays; copies cost no draft forward (policy/lookup.py)
    lookup: bool = True
    projection: Projection = "on_demand"  # on_demand (cpu unit, accepted path) or eager (npu)
    # single: both units on one thread, one OpenMP team that spins (device/units.py);
    # split: small work on a "cpu" unit beside the "npu", each team sleeping when idle.
    # One team decoded 1.4x as fast resident and as fast or faster streamed (docs/benchmarks.md)
    units: Units = "single"
    draft_dtype: DraftDtype = "bfloat16"
    draft_weights: Weights = "auto"  # auto: a GGUF draft stays in its own precision class
    # the draft proposes only token ids below this, so that its LM head multiplies those
    # rows alone (BPE ids grow as merges grow rare: the real pair's first 65,536 cover about
    # 98% of prompt tokens, and the head cost a third of a draft round); None: every id
    draft_vocabulary: Annotated[int, msgspec.Meta(gt=0)] | None = DRAFT_VOCABULARY
    # the draft prefills at most a prompt's last this many new tokens: it proposes from
    # recent text, and a 1,400-token prompt's whole draft prefill was a quarter of the
    # wait for the first token (engine/state.py); None: all of them
    draft_window: Annotated[int, msgspec.Meta(gt=0)] | None = DRAFT_WINDOW
    # tokens a request's prompt and new ones may fill; None: the model's context, or less
    # where the memory left after loading holds less KV (plan/context.py)
    ctx_size: Annotated[int, msgspec.Meta(gt=0)] | None = None
    # requests decoding at once, their trees verified in one pass over the layers (engine/batch.py);
    # more wait for a place, in arrival order. None: as many requests of AUTO_REQUEST_TOKENS
    # as the KV room after loading holds, at most MAX_AUTO_PARALLEL
    parallel: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None
    # bytes of finished requests' KV (target and draft) kept, so that a later request that
    # starts with the same tokens prefills only the rest ("256MiB", bytes; 0: none)
    prompt_cache: Annotated[int, msgspec.Meta(ge=0)] = DEFAULT_PROMPT_CACHE
    # where prefixes the prompt cache lets go of, and all it holds at close, are kept (at
    # most SPILLED_PROMPT_CACHE bytes), for later requests and later engines; None: nowhere
    prompt_cache_dir: str | None = None
    # a request whose consumer takes no token for this long, its buffer full, is ended
    # (ConsumerStalledError), so that a stalled reader cannot hold the batch's passes; None:
    # never
    stall_seconds: Annotated[float, msgspec.Meta(gt=0)] | None = 60.0
    throttle: Throttle = "none"
    verify_checksums: bool = True  # every flash read, before its bytes are used
    channels: ChannelSizes = ChannelSizes()
    # random sleeps between actor steps, for scheduling fuzz tests
    jitter_seconds: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    seed: int = 0
    trace: str | None = None  # write every message to this file

    def __post_init__(self) -> None:
        if isinstance(self.tree, str):
            msgspec.structs.force_setattr(self, "tree", TreeSpec.parse(self.tree))
        elif self.tree is DEFAULT_TREE and self.draft is None:  # a target alone decodes
            msgspec.structs.force_setattr(self, "tree", TreeSpec("none"))
        if isinstance(self.dram_budget, str | int):
            msgspec.structs.force_setattr(self, "dram_budget", DramBudget.parse(self.dram_budget))
        if isinstance(self.prompt_cache, str):
            msgspec.structs.force_setattr(self, "prompt_cache", parse_bytes(self.prompt_cache))
        _check_fields(self)


def default_of(name: str) -> object:
    """The library's default of an EngineConfig field: the one the CLI's flags show."""
    return next(f.default for f in msgspec.structs.fields(EngineConfig) if f.name == name)


def choices_of(name: str) -> tuple[str, ...] | None:
    """The values an EngineConfig field allows, if they form a set (a Literal)."""
    hint = typing.get_type_hints(EngineConfig)[name]
    return typing.get_args(hint) if _is_literal(hint) else None
