"""Testing support, for our tests and for users': tiny random checkpoints, hypothesis
strategies over engine configurations, and `assert_matches_greedy`, the exactness check.

Everything is float64 on tiny models, where near-ties cannot flip an argmax, so the engine
must emit exactly what sequential greedy decoding of the target emits ("Exactness contract"
in DESIGN.md). A typical property test:

    from hypothesis import given
    from lever_actors.testing import assert_matches_greedy, engine_cases

    @given(case=engine_cases())
    async def test_exact(case):
        await assert_matches_greedy(case.engine_config(), case.prompt, case.max_new_tokens)

Building and converting a checkpoint costs more than decoding a few tokens with it, so
checkpoints and flash layouts are cached per process (a small LRU in a temporary
directory, removed at exit): examples that draw the same model reuse its files.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
import torch
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from lever_actors.checkpoints import export, load_checkpoint
from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.hf import GLOBAL_NAMES, LAYER_NAMES
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.config import ChannelSizes, EngineConfig, TreeSpec
from lever_actors.device.budget import minimum_budget
from lever_actors.device.layout import read_manifest
from lever_actors.draft import DraftModel
from lever_actors.engine import Engine, GenerationResult
from lever_actors.model.args import SUPPORTED_ARCHITECTURES, ModelArgs, RopeScaling
from lever_actors.model.greedy import greedy_reference
from lever_actors.model.transformer import Transformer
from lever_actors.model.weights import layer_tensor_names
from lever_actors.policy.exit_predictor import LowRankAdapter

__all__ = [
    "DRAFT_RELATIONS",
    "EngineCase",
    "ModelPair",
    "assert_matches_greedy",
    "budget_bytes",
    "budgets",
    "channel_sizes",
    "draft_relations",
    "early_exits",
    "engine_cases",
    "flash_layout",
    "hf_config",
    "jitters",
    "model_args",
    "model_pair",
    "perturbed_checkpoint",
    "prompts",
    "prune_thresholds",
    "random_hf_tensors",
    "reference_tokens",
    "ring_slots",
    "seeds",
    "tiny_checkpoint",
    "trees",
    "with_exit_predictor",
    "write_perturbed_copy",
    "write_tiny_checkpoint",
    "write_tiny_tokenizer",
]

Relation = Literal["identical", "perturbed", "independent"]
DRAFT_RELATIONS: tuple[Relation, ...] = ("identical", "perturbed", "independent")

WEIGHT_STD = 0.3  # matrices and biases: logits spread by several units, far from ties
NORM_STD = 0.2  # norm weights: 1 +- this
PERTURBATION = 0.02  # default noise a perturbed target adds to every weight


def hf_config(args: ModelArgs) -> dict:
    """The config.json transformers would write for `args` (RoPE nested and flat)."""
    return {**export.hf_config(args, torch.float64), "pad_token_id": None}


def _layer_shape(args: ModelArgs, name: str) -> tuple[int, ...]:
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return {
        "attn_norm": (args.d_model,),
        "ffn_norm": (args.d_model,),
        "wq": (q, args.d_model),
        "wk": (kv, args.d_model),
        "wv": (kv, args.d_model),
        "wo": (args.d_model, q),
        "bq": (q,),
        "bk": (kv,),
        "bv": (kv,),
        "q_norm": (args.head_dim,),
        "k_norm": (args.head_dim,),
        "w_gate": (args.ffn_dim, args.d_model),
        "w_up": (args.ffn_dim, args.d_model),
        "w_down": (args.d_model, args.ffn_dim),
    }[name]


def random_hf_tensors(args: ModelArgs, seed: int = 0) -> dict[str, torch.Tensor]:
    """float64 weights under their HF names: matrices and biases ~ N(0, 0.3^2), norm weights
    ~ 1 + N(0, 0.2^2). The same (args, seed) always gives the same tensors."""
    generator = torch.Generator().manual_seed(seed)

    def draw(shape: tuple[int, ...], is_norm: bool) -> torch.Tensor:
        noise = torch.randn(shape, generator=generator, dtype=torch.float64)
        return 1.0 + NORM_STD * noise if is_norm else WEIGHT_STD * noise

    tensors = {GLOBAL_NAMES["embed"]: draw((args.vocab_size, args.d_model), False)}
    for i in range(args.n_layers):
        for name in layer_tensor_names(args):
            hf_name = f"model.layers.{i}.{LAYER_NAMES[name]}"
            tensors[hf_name] = draw(_layer_shape(args, name), "norm" in name)
    tensors[GLOBAL_NAMES["final_norm"]] = draw((args.d_model,), True)
    if not args.tie_embeddings:
        tensors["lm_head.weight"] = draw((args.vocab_size, args.d_model), False)
    return tensors


def write_tiny_tokenizer(directory: Path, vocab_size: int, eos_id: int | None = None) -> None:
    """A word-level tokenizer over the words t0 .. t<vocab-1> (token i is "t<i>"), with
    `eos_id` as the end-of-sequence token the engine stops on."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(directory / "tokenizer.json"))
    eos = None if eos_id is None else f"t{eos_id}"
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))


def write_tiny_checkpoint(
    directory: Path,
    args: ModelArgs,
    *,
    seed: int = 0,
    tokenizer: bool = False,
    eos_id: int | None = None,
) -> Path:
    """Write a random float64 HF checkpoint (config.json + model.safetensors) for `args`.

    With `tokenizer` (implied by `eos_id`) a word-level tokenizer.json goes beside it.
    """
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(args), indent=2))
    save_file(random_hf_tensors(args, seed), str(directory / "model.safetensors"))
    if tokenizer or eos_id is not None:
        write_tiny_tokenizer(directory, args.vocab_size, eos_id)
    return directory


def write_perturbed_copy(
    source: Path, directory: Path, *, seed: int, scale: float = PERTURBATION
) -> Path:
    """Copy the HF checkpoint `source`, adding N(0, scale^2) noise to every tensor: a model
    close to the source, as a target is close to a good draft. Other files are copied."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, directory / path.name)
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(str(source / "model.safetensors"))
    noisy = {
        name: t + scale * torch.randn(t.shape, generator=generator, dtype=t.dtype)
        for name, t in sorted(tensors.items())
    }
    save_file(noisy, str(directory / "model.safetensors"))
    return directory


# --- the per-process cache ----------------------------------------------------------------


class _FileCache:
    """Directories made on demand under one temporary root, least recently used evicted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[object, Path] = OrderedDict()
        self.made = 0
        self._root: Path | None = None

    def get(self, key: object, make: Callable[[Path], object]) -> Path:
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        self.made += 1
        path = self.root / f"{self.made:06d}"  # never reused: loaded models are keyed by path
        make(path)
        self.entries[key] = path
        while len(self.entries) > self.capacity:
            _, old = self.entries.popitem(last=False)
            shutil.rmtree(old, ignore_errors=True)
        return path

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="lever-actors-testing-"))
            atexit.register(shutil.rmtree, self._root, True)
        return self._root


_checkpoints = _FileCache(capacity=96)
_layouts = _FileCache(capacity=64)
_references: OrderedDict[Path, tuple[Transformer, Tokenizer | None]] = OrderedDict()


def tiny_checkpoint(
    args: ModelArgs, seed: int = 0, *, tokenizer: bool = False, eos_id: int | None = None
) -> Path:
    """`write_tiny_checkpoint` into the process cache; the returned directory is shared."""
    tokenizer = tokenizer or eos_id is not None
    return _checkpoints.get(
        ("random", args, seed, tokenizer, eos_id),
        lambda path: write_tiny_checkpoint(
            path, args, seed=seed, tokenizer=tokenizer, eos_id=eos_id
        ),
    )


def perturbed_checkpoint(
    args: ModelArgs,
    seed: int = 0,
    *,
    noise_seed: int = 1,
    scale: float = PERTURBATION,
    tokenizer: bool = False,
    eos_id: int | None = None,
) -> Path:
    """The cached `tiny_checkpoint(args, seed)` plus noise (see `write_perturbed_copy`)."""
    base = tiny_checkpoint(args, seed, tokenizer=tokenizer, eos_id=eos_id)
    return _checkpoints.get(
        ("perturbed", base, noise_seed, scale),
        lambda path: write_perturbed_copy(base, path, seed=noise_seed, scale=scale),
    )


def flash_layout(checkpoint: Path) -> Path:
    """The float64 flash layout of an HF checkpoint directory, converted once per process."""
    return _layouts.get(
        ("layout", Path(checkpoint)),
        lambda path: convert(Path(checkpoint), path, torch.float64),
    )


@dataclass(frozen=True)
class ModelPair:
    target: Path  # float64 flash layout
    draft: Path  # HF checkpoint directory


def model_pair(
    args: ModelArgs,
    relation: Relation,
    seed: int = 0,
    *,
    draft_args: ModelArgs | None = None,
    tokenizer: bool = False,
    eos_id: int | None = None,
    scale: float = PERTURBATION,
) -> ModelPair:
    """A target layout and a draft checkpoint, related as `relation` says:

    identical: the draft is the target's own checkpoint; perturbed: the target is the draft
    plus noise of std `scale`; independent: two unrelated random models (the draft built
    from `draft_args`, which must share the vocabulary, or `args`).
    With `tokenizer` both carry the same word-level tokenizer (see `write_tiny_tokenizer`),
    and with `eos_id` it ends generation on that token.
    """
    tok = dict(tokenizer=tokenizer, eos_id=eos_id)
    if relation == "identical":
        draft = target = tiny_checkpoint(args, seed, **tok)
    elif relation == "perturbed":
        draft = tiny_checkpoint(args, seed, **tok)
        target = perturbed_checkpoint(args, seed, noise_seed=seed + 1, scale=scale, **tok)
    elif relation == "independent":
        draft_args = draft_args or args
        if draft_args.vocab_size != args.vocab_size:
            raise ValueError("an independent draft must share the target's vocabulary")
        target = tiny_checkpoint(args, seed, **tok)
        draft = tiny_checkpoint(draft_args, seed + 1, **tok)
    else:
        raise ValueError(f"unknown draft relation {relation!r}; use one of {DRAFT_RELATIONS}")
    return ModelPair(target=flash_layout(target), draft=draft)


def budget_bytes(layout: Path, budget: float | str, ring_slots: int = 2) -> int | str:
    """A `budgets()` value for this layout: "all" as is, a fraction f as bytes between the
    least the engine accepts (f = 0) and the whole weights file (f = 1)."""
    if isinstance(budget, str):
        return budget
    manifest = read_manifest(Path(layout))
    least = minimum_budget(manifest, ring_slots)
    return least + round(budget * max(manifest.file_bytes - least, 0))


def with_exit_predictor(layout: Path, exit_layer: int, *, seed: int = 0, rank: int = 4) -> Path:
    """A cached copy of `layout` with a random low-rank exit predictor beside it (what
    `lever-actors train-exit` would save), so early_exit "trained" has one to load."""
    layout = Path(layout)

    def make(path: Path) -> None:
        shutil.copytree(layout, path)
        d_model = read_manifest(layout).args.d_model
        generator = torch.Generator().manual_seed(seed)
        down, up = (
            WEIGHT_STD * torch.randn(shape, generator=generator, dtype=torch.float64)
            for shape in ((rank, d_model), (d_model, rank))
        )
        LowRankAdapter(down, up, exit_layer).save(path)

    return _layouts.get(("predictor", layout, exit_layer, seed, rank), make)


# --- the oracle -------------------------------------------------------------------------


def _reference_model(layout: Path) -> tuple[Transformer, Tokenizer | None]:
    """The target loaded whole in float64, and its tokenizer, cached per layout."""
    layout = Path(layout)
    if layout not in _references:
        checkpoint = load_checkpoint(layout, torch.float64)
        model = Transformer(checkpoint.args, checkpoint.weights)
        _references[layout] = (model, checkpoint.tokenizer)
        while len(_references) > 16:
            _references.popitem(last=False)
    _references.move_to_end(layout)
    return _references[layout]


def reference_tokens(
    layout: Path, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[str] = ()
) -> list[int]:
    """Sequential greedy decoding of the target layout in float64 with no KV cache. Like the
    engine it stops after one of its tokenizer's end tokens, or after the first token whose
    text completes one of the `stop` strings."""
    model, tokenizer = _reference_model(layout)
    stop_ids = tokenizer.eos_ids if tokenizer else frozenset()
    tokens = greedy_reference(model, list(prompt), max_new_tokens, stop_ids)
    if stop:
        if tokenizer is None:
            raise ValueError(f"{layout}: stop strings need a target with a tokenizer")
        for end in range(1, len(tokens) + 1):
            if any(s in tokenizer.decode(tokens[:end]) for s in stop):
                return tokens[:end]
    return tokens


async def assert_matches_greedy(
    engine_config: EngineConfig,
    prompt: Sequence[int],
    n: int,
    *,
    stop: Sequence[str] = (),
    draft: DraftModel | None = None,
) -> GenerationResult:
    """Run the engine on `prompt` for `n` new tokens (with `stop` strings, and `draft` if
    given) and assert that its tokens are exactly `reference_tokens` of its target, with a
    message naming the first position that differs. Returns the engine's result.

    The target layout should be float64 (tiny models from this module are); the draft's
    dtype cannot change the output, only the acceptance rate.
    """
    expected = reference_tokens(Path(engine_config.target), prompt, n, stop)
    async with Engine.open(engine_config, draft=draft) as engine:
        result = await engine.generate(list(prompt), max_new_tokens=n, stop=stop)
    got = list(result.tokens)
    if got != expected:
        raise AssertionError(_mismatch(engine_config, list(prompt), n, stop, expected, result))
    return result


def _mismatch(
    config: EngineConfig,
    prompt: list[int],
    n: int,
    stop: Sequence[str],
    expected: list[int],
    result: GenerationResult,
) -> str:
    got = list(result.tokens)
    first = next(
        (i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
        min(len(expected), len(got)),
    )
    step, emitted = 0, 0
    for stats in result.steps:  # which step emitted the first wrong token
        if emitted + stats.new_tokens > first:
            break
        emitted += stats.new_tokens
        step += 1
    return "\n".join(
        [
            f"engine output differs from sequential greedy decoding of the target at new token "
            f"{first} (step {step}); {len(got)} tokens vs {len(expected)} expected",
            f"  prompt:   {prompt}  (max_new_tokens={n}, stop={list(stop)})",
            f"  agreed:   {expected[:first]}",
            f"  expected: ...{expected[first:]}",
            f"  engine:   ...{got[first:]}",
            f"  new tokens per step: {[s.new_tokens for s in result.steps]}",
            f"  tree nodes per step: {[s.tree_nodes for s in result.steps]}",
            f"  config: {msgspec.json.encode(config).decode()}",
        ]
    )


# --- hypothesis strategies ----------------------------------------------------------------


@st.composite
def model_args(
    draw: st.DrawFn,
    *,
    archs: Sequence[str] = SUPPORTED_ARCHITECTURES,
    vocab_size: int | None = None,
    max_layers: int = 4,
) -> ModelArgs:
    """Tiny configs: llama/qwen2/qwen3, 1-4 layers, 1-2 KV heads shared by 1, 2 or 4 query
    heads each, head_dim 8 or 16, vocab 32-128 (or `vocab_size`), tied or untied LM head,
    sometimes linear RoPE scaling."""
    arch = draw(st.sampled_from(archs))
    n_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    scaling = draw(st.sampled_from([None, None, None, RopeScaling(kind="linear", factor=2.0)]))
    return ModelArgs(
        arch=arch,  # type: ignore[arg-type]
        vocab_size=vocab_size or draw(st.integers(32, 128)),
        d_model=draw(st.sampled_from([16, 24, 32])),
        n_layers=draw(st.integers(1, max_layers)),
        n_heads=n_kv_heads * group,
        n_kv_heads=n_kv_heads,
        head_dim=draw(st.sampled_from([8, 16])),
        ffn_dim=draw(st.sampled_from([16, 32, 48])),
        norm_eps=1e-6,
        rope_theta=draw(st.sampled_from([1e4, 5e5, 1e6])),
        max_seq_len=256,
        tie_embeddings=draw(st.booleans()),
        rope_scaling=scaling,
    )


def draft_relations() -> st.SearchStrategy[Relation]:
    return st.sampled_from(DRAFT_RELATIONS)


def prompts(vocab_size: int, *, min_size: int = 1, max_size: int = 12) -> st.SearchStrategy:
    """Token-id prompts; repeated tokens are likely, which is where caches go wrong."""
    tokens = st.integers(0, vocab_size - 1)
    return st.lists(tokens, min_size=min_size, max_size=max_size)


TREE_KINDS = ("chain", "static", "gaincost", "none")  # hypothesis favours the first


@st.composite
def trees(
    draw: st.DrawFn,
    *,
    kinds: Sequence[str] = TREE_KINDS,
    max_chain: int = 6,
    max_nodes: int = 24,
) -> str:
    """Tree policies of the given kinds: "none"; "chain:1".."chain:6"; "static:W1,.." of
    depth 1-4 and widths 1-3; Lever's "gaincost" (default cap) or "gaincost:CAP". Static
    trees and caps stay within `max_nodes` draft nodes."""
    kind = draw(st.sampled_from(kinds))
    if kind == "none":
        return "none"
    if kind == "chain":
        return f"chain:{draw(st.integers(1, max_chain))}"
    if kind == "gaincost":
        cap = draw(st.one_of(st.none(), st.integers(1, max_nodes)))
        return "gaincost" if cap is None else f"gaincost:{cap}"
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
    return st.builds(
        ChannelSizes,
        requests=small,
        trees=small,
        probes=small,
        verdicts=small,
        finals=small,
        commits=small,
        results=small,
        events=st.integers(1, 8),
    )


def jitters(*, always: bool = False) -> st.SearchStrategy[float]:
    """Maximum random pause (seconds) of each actor per message: none (unless `always`),
    or up to 2 ms."""
    some = st.floats(1e-5, 2e-3)
    return some if always else st.one_of(st.just(0.0), some)


EARLY_EXITS = ("lens", "trained", "none", "off")  # pruning ones first: more often drawn


def early_exits(kinds: Sequence[str] = EARLY_EXITS) -> st.SearchStrategy[str]:
    """The pruner's predictor. "trained" runs a random low-rank adapter (see
    `with_exit_predictor`): exactness cannot depend on how good the predictor is."""
    return st.sampled_from(kinds)


def prune_thresholds() -> st.SearchStrategy[float]:
    """From the default to thresholds that drop most branches."""
    return st.one_of(st.floats(0.0, 0.9), st.sampled_from([0.02, 0.0]))


def seeds() -> st.SearchStrategy[int]:
    return st.integers(0, 2**16 - 1)


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
    early_exit: str
    exit_layer: int | None
    prune_threshold: float
    prune_when: str
    audit_every: int
    draft_ahead: bool
    projection: str
    channels: ChannelSizes
    jitter_seconds: float
    seed: int

    def models(self, *, tokenizer: bool = False, eos_id: int | None = None) -> ModelPair:
        """Build (or reuse) the checkpoints; see `model_pair` for the keywords."""
        pair = model_pair(
            self.args,
            self.relation,
            self.model_seed,
            draft_args=self.draft_args,
            tokenizer=tokenizer,
            eos_id=eos_id,
            scale=self.scale,
        )
        if self.early_exit != "trained":
            return pair
        exit_layer = self.args.n_layers // 2 if self.exit_layer is None else self.exit_layer
        target = with_exit_predictor(pair.target, exit_layer, seed=self.model_seed)
        return ModelPair(target=target, draft=pair.draft)

    def engine_config(self, *, tokenizer: bool = False, eos_id: int | None = None) -> EngineConfig:
        """The engine's config for this case, over `models(...)`."""
        pair = self.models(tokenizer=tokenizer, eos_id=eos_id)
        return EngineConfig(
            target=str(pair.target),
            draft=str(pair.draft),
            dram_budget=budget_bytes(pair.target, self.budget, self.ring_slots),
            ring_slots=self.ring_slots,
            tree=self.tree,
            early_exit=self.early_exit,
            exit_layer=self.exit_layer,
            prune_threshold=self.prune_threshold,
            prune_when=self.prune_when,
            audit_every=self.audit_every,
            draft_ahead=self.draft_ahead,
            projection=self.projection,
            draft_dtype="float64",
            channels=self.channels,
            jitter_seconds=self.jitter_seconds,
            seed=self.seed,
        )


def _given(draw: st.DrawFn, strategy: st.SearchStrategy | None, default: st.SearchStrategy):
    return draw(strategy if strategy is not None else default)


@st.composite
def engine_cases(
    draw: st.DrawFn,
    *,
    models: st.SearchStrategy[ModelArgs] | None = None,
    relations: st.SearchStrategy[Relation] | None = None,
    model_seeds: st.SearchStrategy[int] | None = None,
    new_tokens: st.SearchStrategy[int] | None = None,
    tree_shapes: st.SearchStrategy[str] | None = None,
    dram_budgets: st.SearchStrategy[float | str] | None = None,
    predictors: st.SearchStrategy[str] | None = None,
    projections: st.SearchStrategy[str] | None = None,
    channels: st.SearchStrategy[ChannelSizes] | None = None,
    jitter: st.SearchStrategy[float] | None = None,
) -> EngineCase:
    """Every dimension at once; pass a narrower strategy for any of them."""
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
        scale=draw(st.sampled_from([0.003, 0.01, 0.03])) if relation == "perturbed" else 0.0,
        prompt=draw(prompts(args.vocab_size)),
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
    )
