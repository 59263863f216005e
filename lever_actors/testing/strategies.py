"""Hypothesis strategies over tiny models, requests and engine settings, and `EngineCase`,
one drawn configuration that builds its own models and engine config."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

try:
    from hypothesis import strategies as st
except ImportError as missing:
    raise ImportError(
        "lever_actors.testing's strategies need hypothesis: "
        "pip install 'lever-actors[dev]' or pip install hypothesis"
    ) from missing

from lever_actors.config import (
    ChannelSizes,
    DramBudget,
    EarlyExit,
    EngineConfig,
    Projection,
    PruneWhen,
    Throttle,
    TreeSpec,
    Weights,
)
from lever_actors.model.args import SUPPORTED_ARCHITECTURES, ModelArgs, RopeScaling
from lever_actors.model.grammar import Grammar
from lever_actors.model.sampling import GREEDY, Sampling
from lever_actors.testing.checkpoints import (
    DRAFT_RELATIONS,
    TWIN_GAP,
    ModelPair,
    Relation,
    TinyTokenizer,
    arch_features,
    bf16_args,
    budget_bytes,
    model_pair,
    with_exit_predictor,
)
from lever_actors.text.tool_calls import call_grammar


@st.composite
def model_args(
    draw: st.DrawFn,
    *,
    archs: Sequence[str] = SUPPORTED_ARCHITECTURES,
    vocab_size: int | None = None,
    max_layers: int = 4,
) -> ModelArgs:
    """Tiny configs of every architecture, 1-4 layers, 1-2 KV heads shared by 1, 2 or 4 query
    heads each, head_dim 8 or 16, vocab 32-128 (or `vocab_size`), tied or untied LM head,
    sometimes linear RoPE scaling; sliding windows of 2-12 positions where the architecture
    has them (see `arch_features`)."""
    arch = draw(st.sampled_from(archs))
    n_layers = draw(st.integers(1, max_layers))
    window = draw(st.one_of(st.none(), st.integers(2, 12)))
    n_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    scaling = draw(st.sampled_from([None, None, None, RopeScaling(kind="linear", factor=2.0)]))
    return ModelArgs(
        arch=arch,  # type: ignore[arg-type]
        vocab_size=vocab_size or draw(st.integers(32, 128)),
        d_model=draw(st.sampled_from([16, 24, 32])),
        n_layers=n_layers,
        n_heads=n_kv_heads * group,
        n_kv_heads=n_kv_heads,
        head_dim=draw(st.sampled_from([8, 16])),
        ffn_dim=draw(st.sampled_from([16, 32, 48])),
        norm_eps=1e-6,
        rope_theta=draw(st.sampled_from([1e4, 5e5, 1e6])),
        max_seq_len=256,
        tie_embeddings=draw(st.booleans()),
        rope_scaling=scaling,
        **arch_features(arch, n_layers, window),
    )


def bf16_model_args(
    archs: Sequence[str] = SUPPORTED_ARCHITECTURES,
) -> st.SearchStrategy[ModelArgs]:
    """`bf16_args` of each architecture, tied or untied LM head."""
    return st.builds(bf16_args, st.sampled_from(archs), tie_embeddings=st.booleans())


def draft_relations() -> st.SearchStrategy[Relation]:
    return st.sampled_from(DRAFT_RELATIONS)


def prompts(vocab_size: int, *, min_size: int = 1, max_size: int = 12) -> st.SearchStrategy:
    """Token-id prompts; repeated tokens are likely, which is where caches go wrong."""
    tokens = st.integers(0, vocab_size - 1)
    return st.lists(tokens, min_size=min_size, max_size=max_size)


@st.composite
def repetitive_prompts(
    draw: st.DrawFn, vocab_size: int, *, min_size: int = 1, max_size: int = 12
) -> list[int]:
    """A pattern of 1-4 tokens repeated, cut to `min_size`-`max_size` tokens: text like code
    and lists, where real drafts are accepted for long stretches."""
    pattern = draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=4))
    size = draw(st.integers(min_size, max_size))
    return (pattern * size)[:size]


TREE_KINDS = ("chain", "static", "gaincost", "lookup", "none")  # hypothesis favours the first


@st.composite
def trees(
    draw: st.DrawFn,
    *,
    kinds: Sequence[str] = TREE_KINDS,
    max_chain: int = 6,
    max_nodes: int = 24,
) -> str:
    """Tree policies of the given kinds: "none"; "chain:1".."chain:6"; "static:W1,.." of
    depth 1-4 and widths 1-3; Lever's "gaincost" (default cap) or "gaincost:CAP"; copies
    alone, "lookup" or "lookup:CAP". Static trees and caps stay within `max_nodes` draft
    nodes."""
    kind = draw(st.sampled_from(kinds))
    if kind == "none":
        return "none"
    if kind == "chain":
        return f"chain:{draw(st.integers(1, max_chain))}"
    if kind in ("gaincost", "lookup"):
        cap = draw(st.one_of(st.none(), st.integers(1, max_nodes)))
        return kind if cap is None else f"{kind}:{cap}"
    widths: list[int] = []
    level = total = 0
    for _ in range(draw(st.integers(1, 4))):
        level = level or 1
        most = min(3, (max_nodes - total) // level)
        if most < 1:
            break
        width = draw(st.integers(1, most))
        widths.append(width)
        level *= width
        total += level
    spec = f"static:{','.join(map(str, widths))}"
    assert TreeSpec.parse(spec).max_nodes <= max_nodes
    return spec


LARGE_TREE_KINDS = ("static", "gaincost", "chain")


@st.composite
def large_trees(
    draw: st.DrawFn,
    *,
    kinds: Sequence[str] = LARGE_TREE_KINDS,
    min_nodes: int = 33,
    max_nodes: int = 96,
    max_chain: int = 8,
) -> str:
    """Trees verified in passes of more rows than a kernel may take before it rounds
    differently: static trees of `min_nodes` to `max_nodes` draft nodes, 2 or 3 levels of
    2-8 children ("static:6,6" has 42, "static:8,8" 72); gain-cost with its default cap or
    one in that range (its trees grow that large when flash paces the pass); and, for the
    small passes between, "chain:1" to "chain:`max_chain`"."""
    kind = draw(st.sampled_from(kinds))
    if kind == "chain":
        return f"chain:{draw(st.integers(1, max_chain))}"
    if kind == "gaincost":
        cap = draw(st.one_of(st.none(), st.integers(min_nodes, max_nodes)))
        return "gaincost" if cap is None else f"gaincost:{cap}"
    shapes = [
        widths
        for depth in (2, 3)
        for widths in itertools.product(range(2, 9), repeat=depth)
        if min_nodes <= TreeSpec("static", widths).max_nodes <= max_nodes
    ]
    shapes.sort(key=lambda widths: TreeSpec("static", widths).max_nodes)  # shrink to smaller
    return f"static:{','.join(map(str, draw(st.sampled_from(shapes))))}"


def budgets() -> st.SearchStrategy[float | str]:
    """DRAM budgets as `budget_bytes` reads them: "all", or a fraction of the way from the
    least the engine accepts (0.0: LM head, final norm and the ring) to everything (1.0)."""
    return st.one_of(
        st.just("all"), st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0, allow_nan=False)
    )


def ring_slots() -> st.SearchStrategy[int]:
    return st.integers(2, 4)


def channel_sizes() -> st.SearchStrategy[ChannelSizes]:
    """Every capacity small (1-3; 1-8 events), where back-pressure and ordering bugs show."""
    small = st.integers(1, 3)
    # every channel by its field name, in field order, so a renamed channel needs no edit here
    capacities = {name: small for name in ChannelSizes.__struct_fields__}
    return st.builds(ChannelSizes, **{**capacities, "events": st.integers(1, 8)})


def jitters(*, always: bool = False) -> st.SearchStrategy[float]:
    """Maximum random pause (seconds) of each actor per message: none (unless `always`),
    or up to 2 ms."""
    some = st.floats(1e-5, 2e-3)
    return some if always else st.one_of(st.just(0.0), some)


# pruning ones first: more often drawn
EARLY_EXITS: tuple[EarlyExit, ...] = ("lens", "trained", "probe_only", "off")


def early_exits(kinds: Sequence[EarlyExit] = EARLY_EXITS) -> st.SearchStrategy[EarlyExit]:
    """The pruner's predictor. "trained" runs a random low-rank adapter (see
    `with_exit_predictor`): exactness cannot depend on how good the predictor is."""
    return st.sampled_from(kinds)


def prune_thresholds() -> st.SearchStrategy[float]:
    """From the default to thresholds that drop most branches."""
    return st.one_of(st.floats(0.0, 0.9), st.sampled_from([0.02, 0.0]))


def seeds() -> st.SearchStrategy[int]:
    return st.integers(0, 2**16 - 1)


def samplings() -> st.SearchStrategy[Sampling]:
    """Seeded sampling: temperatures from sharp to flat, with and without each filter."""
    return st.builds(
        Sampling,
        temperature=st.sampled_from([0.3, 0.7, 1.0, 1.5]),
        top_k=st.sampled_from([0, 2, 5, 40]),
        top_p=st.sampled_from([1.0, 0.9, 0.5]),
        min_p=st.sampled_from([0.0, 0.05, 0.3]),
        seed=st.integers(0, 2**64 - 1),
    )


def grammars() -> st.SearchStrategy[Grammar]:
    """Grammars of each kind, for byte-level vocabularies (`write_byte_tokenizer`): any
    JSON object, schemas of an object and of an array, a regex, a Lark grammar and a
    required tool call (whose markers are tokens of that vocabulary)."""
    person = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    return st.sampled_from(
        [
            Grammar("json"),
            Grammar.json_schema(person),
            Grammar.json_schema({"type": "array", "items": {"enum": [1, 2, "three", None]}}),
            Grammar("regex", r"(the|a) (quick|lazy) [a-z]{1,8}\."),
            Grammar("lark", 'start: item (", " item)*\nitem: /[0-9]+/ | "true" | "false"'),
            call_grammar([{"name": "now"}, {"name": "find", "parameters": person}], True, True),
        ]
    )


@dataclass(frozen=True)
class EngineCase:
    """One drawn configuration: models, request and engine settings. Its repr is what
    hypothesis prints for a failing example, enough to rebuild it."""

    args: ModelArgs
    relation: Relation
    draft_args: ModelArgs | None  # the independent draft's own config
    model_seed: int
    scale: float  # noise of a perturbed target
    prompt: list[int]
    max_new_tokens: int
    tree: str
    budget: float | str
    ring_slots: int
    early_exit: EarlyExit
    exit_layer: int | None
    prune_threshold: float
    prune_when: PruneWhen
    audit_every: int
    draft_ahead: bool
    projection: Projection
    channels: ChannelSizes
    jitter_seconds: float
    seed: int
    dtype: torch.dtype = torch.float64  # the target layout's, which the engine computes in
    twin_gap: float | None = None  # see `random_hf_tensors`
    throttle: Throttle = "none"  # emulated flash
    sampling: Sampling = GREEDY  # the request's
    weights: Weights = "dense"  # the target layout's matrices, and the draft's
    draft_window: int | None = None  # the prompt tokens the draft prefills at most

    def models(self, *, tokenizer: TinyTokenizer = "none", eos_id: int | None = None) -> ModelPair:
        """Build (or reuse) the checkpoints; see `model_pair` for the keywords."""
        pair = model_pair(
            self.args,
            self.relation,
            self.model_seed,
            draft_args=self.draft_args,
            tokenizer=tokenizer,
            eos_id=eos_id,
            scale=self.scale,
            dtype=self.dtype,
            twin_gap=self.twin_gap,
            weights=self.weights,
        )
        if self.early_exit != "trained":
            return pair
        exit_layer = self.args.n_layers // 2 if self.exit_layer is None else self.exit_layer
        target = with_exit_predictor(pair.target, exit_layer, seed=self.model_seed)
        return ModelPair(target=target, draft=pair.draft)

    def engine_config(
        self, *, tokenizer: TinyTokenizer = "none", eos_id: int | None = None
    ) -> EngineConfig:
        """The engine's config for this case, over `models(...)`."""
        pair = self.models(tokenizer=tokenizer, eos_id=eos_id)
        return EngineConfig(
            target=str(pair.target),
            draft=str(pair.draft),
            dram_budget=DramBudget.parse(budget_bytes(pair.target, self.budget, self.ring_slots)),
            ring_slots=self.ring_slots,
            tree=TreeSpec.parse(self.tree),
            early_exit=self.early_exit,
            exit_layer=self.exit_layer,
            prune_threshold=self.prune_threshold,
            prune_when=self.prune_when,
            audit_every=self.audit_every,
            draft_ahead=self.draft_ahead,
            projection=self.projection,
            draft_dtype=str(self.dtype).removeprefix("torch."),  # type: ignore[arg-type]  # a layout dtype, a DraftDtype
            draft_weights=self.weights,
            throttle=self.throttle,
            channels=self.channels,
            jitter_seconds=self.jitter_seconds,
            seed=self.seed,
            draft_window=self.draft_window,
        )


def draft_windows() -> st.SearchStrategy[int | None]:
    """The draft's view of a prompt: all of it, or its last few tokens (the tiny prompts'
    lengths), so that the draft sees less than the target does."""
    return st.one_of(st.none(), st.integers(1, 12))


def _given(draw: st.DrawFn, strategy: st.SearchStrategy | None, default: st.SearchStrategy):
    return draw(strategy if strategy is not None else default)


@st.composite
def engine_cases(
    draw: st.DrawFn,
    *,
    models: st.SearchStrategy[ModelArgs] | None = None,
    relations: st.SearchStrategy[Relation] | None = None,
    model_seeds: st.SearchStrategy[int] | None = None,
    scales: st.SearchStrategy[float] | None = None,
    prompt_lists: Callable[[int], st.SearchStrategy[list[int]]] = prompts,
    new_tokens: st.SearchStrategy[int] | None = None,
    tree_shapes: st.SearchStrategy[str] | None = None,
    dram_budgets: st.SearchStrategy[float | str] | None = None,
    predictors: st.SearchStrategy[EarlyExit] | None = None,
    projections: st.SearchStrategy[Projection] | None = None,
    channels: st.SearchStrategy[ChannelSizes] | None = None,
    jitter: st.SearchStrategy[float] | None = None,
    throttles: st.SearchStrategy[Throttle] | None = None,
    sampling: st.SearchStrategy[Sampling] | None = None,
    weights: st.SearchStrategy[str] | None = None,
    windows: st.SearchStrategy[int | None] | None = None,
    dtype: torch.dtype = torch.float64,
    twin_gap: float | None = None,
) -> EngineCase:
    """Every dimension at once; pass a narrower strategy for any of them (`prompt_lists`
    gets the drawn vocabulary size). The target layout stores `dtype`, and `twin_gap` makes
    every model's vocabulary come in near-tied twins (see `random_hf_tensors`). Requests are
    greedy unless `sampling` draws otherwise (`samplings()`)."""
    args = _given(draw, models, model_args())
    relation = _given(draw, relations, draft_relations())
    draft_args = None
    if relation == "independent":
        draft_args = draw(model_args(vocab_size=args.vocab_size, max_layers=2))
    return EngineCase(
        args=args,
        relation=relation,
        draft_args=draft_args,
        model_seed=_given(draw, model_seeds, seeds()),
        scale=_given(draw, scales, st.sampled_from([0.003, 0.01, 0.03]))
        if relation == "perturbed"
        else 0.0,
        prompt=draw(prompt_lists(args.vocab_size)),
        max_new_tokens=_given(draw, new_tokens, st.integers(1, 24)),
        tree=_given(draw, tree_shapes, trees()),
        budget=_given(draw, dram_budgets, budgets()),
        ring_slots=draw(ring_slots()),
        early_exit=_given(draw, predictors, early_exits()),
        exit_layer=draw(st.one_of(st.none(), st.integers(0, args.n_layers - 1))),
        prune_threshold=draw(prune_thresholds()),
        prune_when=draw(st.sampled_from(["compute_bound", "always"])),
        audit_every=draw(st.integers(0, 3)),
        draft_ahead=draw(st.booleans()),
        projection=_given(draw, projections, st.sampled_from(["on_demand", "eager"])),
        channels=_given(draw, channels, channel_sizes()),
        jitter_seconds=_given(draw, jitter, jitters()),
        seed=draw(seeds()),
        dtype=dtype,
        twin_gap=twin_gap,
        throttle=_given(draw, throttles, st.just("none")),
        sampling=_given(draw, sampling, st.just(GREEDY)),
        weights=_given(draw, weights, st.just("dense")),
        draft_window=_given(draw, windows, draft_windows()),
    )


# prompt and new tokens together. The oracle recomputes the whole sequence for each token, and
# up to 32 rows every kernel here rounds a row as it would alone: so even where the engine's
# matrix products are not batch-invariant, the oracle is one-token decoding
BF16_MAX_SEQUENCE = 32
BF16_PROMPT = 8  # the longest prompt


def bf16_engine_cases(**narrower: Any) -> st.SearchStrategy[EngineCase]:
    """`engine_cases` for exactness in bf16, where near-ties are likely and rounding decides
    them: bf16 targets (`bf16_args`) whose vocabularies come in near-tied twins (`TWIN_GAP`),
    drafts they are close copies of (noise of 0.001-0.003, or none), repetitive prompts of
    2 to 8 tokens and 24 new ones, trees that mostly verify more than 32 nodes a
    pass (`large_trees`), every layer streamed from throttled flash, which paces the pass (so
    gain-cost trees grow large too), target and draft dense or quantized to 4 or 8 bits, and
    a few model seeds, so that examples share checkpoints. Keywords narrow it as in
    `engine_cases`."""
    defaults: dict[str, Any] = dict(  # engine_cases's keywords
        models=bf16_model_args(),
        relations=st.sampled_from(["perturbed", "identical"]),
        model_seeds=st.integers(0, 2),
        scales=st.sampled_from([0.001, 0.003]),
        prompt_lists=lambda vocab: repetitive_prompts(vocab, min_size=2, max_size=BF16_PROMPT),
        new_tokens=st.just(BF16_MAX_SEQUENCE - BF16_PROMPT),  # each a near-tie that may flip
        tree_shapes=large_trees(),
        dram_budgets=st.just(0.0),
        throttles=st.just("ufs3.1"),
        weights=st.sampled_from(["dense", "q4", "q8"]),
    )
    return engine_cases(dtype=torch.bfloat16, twin_gap=TWIN_GAP, **{**defaults, **narrower})
