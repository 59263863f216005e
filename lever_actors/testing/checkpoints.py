"""Tiny random checkpoints for tests: float64 HF checkpoints written from `ModelArgs`, noisy
copies of them, a word-level tokenizer, their flash layouts (float64, or bf16 for models
sized by `bf16_args`) and exit predictors, all cached per process (a small LRU in a
temporary directory, removed at exit): building and converting a checkpoint costs more than
decoding a few tokens with it."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

from lever_actors.checkpoints import export
from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.hf import hf_name
from lever_actors.config import Weights
from lever_actors.device.budget import minimum_budget
from lever_actors.device.manifest import read_manifest
from lever_actors.model.args import Architecture, ModelArgs
from lever_actors.model.shapes import expected_shapes, is_norm
from lever_actors.model.weights import stored_tensors
from lever_actors.policy.exit_predictor import LowRankAdapter

Relation = Literal["identical", "perturbed", "independent"]
DRAFT_RELATIONS: tuple[Relation, ...] = ("identical", "perturbed", "independent")

WEIGHT_STD = 0.3  # matrices and biases: logits spread by several units, far from ties
NORM_STD = 0.2  # norm weights: 1 +- this
PERTURBATION = 0.02  # default noise a perturbed target adds to every weight
# twins this close often tie after bf16 rounding: a rounding difference then decides them
TWIN_GAP = 0.003


# A two-layer llama of width 16 over 32 tokens: the smallest model a test of the API needs.
TINY_ARGS = ModelArgs(
    arch="llama",
    vocab_size=32,
    d_model=16,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    head_dim=8,
    ffn_dim=16,
    norm_eps=1e-6,
    rope_theta=1e4,
    max_seq_len=256,
    tie_embeddings=False,
)


def arch_features(arch: str, n_layers: int, window: int | None) -> dict[str, Any]:
    """The ModelArgs fields particular to `arch` for a tiny model: a sliding `window` on
    every layer (Mistral, Phi-3) or every other one (Gemma 2, which also gets soft caps small
    enough to change scores and logits, and a query scale other than head_dim)."""
    if arch not in ("mistral", "phi3", "gemma2") or window is None:
        return {}
    every = 2 if arch == "gemma2" else 1
    features: dict[str, Any] = {
        "sliding_window": window,
        "sliding_layers": tuple(range(0, n_layers, every)),
    }
    if arch == "gemma2":
        features |= {"attn_softcap": 5.0, "final_softcap": 8.0, "query_scale": 24.0}
    return features


def bf16_args(arch: Architecture = "qwen2", *, tie_embeddings: bool = False) -> ModelArgs:
    """The smallest config where bf16 rounding depends on how many rows a matrix product
    has: matrices of 512 and 1024 inputs (oneDNN switches kernel past 32 rows there, not at
    256), heads of 128 dims, and 4 layers, through which a rounding difference spreads to
    most rows (with 2, few generations ever meet a flipped argmax)."""
    return ModelArgs(
        arch=arch,
        vocab_size=1024,
        d_model=512,
        n_layers=4,
        n_heads=4,
        n_kv_heads=1,
        head_dim=128,
        ffn_dim=1024,
        norm_eps=1e-6,
        rope_theta=1e6,
        max_seq_len=512,
        tie_embeddings=tie_embeddings,
        **arch_features(arch, 4, window=16),
    )


def hf_config(args: ModelArgs) -> dict:
    """The config.json transformers would write for `args` (RoPE nested and flat)."""
    return {**export.hf_config(args, torch.float64), "pad_token_id": None}


def random_hf_tensors(
    args: ModelArgs, seed: int = 0, *, twin_gap: float | None = None
) -> dict[str, torch.Tensor]:
    """float64 weights under their HF names: matrices and biases ~ N(0, 0.3^2), norm weights
    ~ 1 + N(0, 0.2^2). The same (args, seed, twin_gap) always gives the same tensors.

    With `twin_gap` the vocabulary comes in twins: the LM head's row 2k+1 is row 2k plus
    N(0, twin_gap^2) noise, so the twins' logits nearly tie (as "the" and " the" do in a
    real vocabulary) and a rounding difference may decide between them."""
    generator = torch.Generator().manual_seed(seed)

    def draw(ours: str) -> torch.Tensor:
        noise = torch.randn(shapes[ours], generator=generator, dtype=torch.float64)
        if is_norm(ours):  # the weight applied is 1 + noise, whatever the HF convention
            return 1.0 - args.norm_offset + NORM_STD * noise
        return WEIGHT_STD * noise

    shapes = expected_shapes(args)
    tensors = {hf_name(ours, layer, args): draw(ours) for ours, layer in stored_tensors(args)}
    if twin_gap is not None:
        head = tensors[hf_name("embed" if args.tie_embeddings else "lm_head", None, args)]
        noise = torch.randn(head[1::2].shape, generator=generator, dtype=torch.float64)
        head[1::2] = head[0::2][: len(noise)] + twin_gap * noise
    return tensors


def write_tiny_tokenizer(directory: Path, vocab_size: int, eos_id: int | None = None) -> None:
    """A word-level tokenizer over the words t0 .. t<vocab-1> (token i is "t<i>"), with
    `eos_id` as the end-of-sequence token the engine stops on: a special token, which
    decoding leaves out of the text."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = None if eos_id is None else f"t{eos_id}"
    if eos is not None:
        backend.add_special_tokens([AddedToken(eos, special=True, normalized=False)])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))


# Merges of the byte-level tokenizer are learned from this text: JSON and prose, as
# grammars write them.
_BYTE_CORPUS = """
{"name": "Ada", "age": 36, "tags": ["math", "code"], "active": true, "score": null}
{"id": 12, "items": [{"name": "pen", "price": 1.5}, {"name": "ink", "price": 0.25}]}
[1, 2, 3, 4, 5, 6, 7, 8, 9, 10] {"a": {"b": {"c": "deep"}}, "list": [], "empty": {}}
The quick brown fox jumps over the lazy dog. A grammar decides which tokens may follow.
def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n
"""
TinyTokenizer = Literal["none", "words", "bytes"]
BYTE_VOCAB = 320  # the 256 bytes, 61 merges, the two tool-call markers and the end token
END_TOKEN = "<|endoftext|>"
TOOL_MARKERS = ("<tool_call>", "</tool_call>")  # tokens of their own, as in Qwen's vocabulary


def write_byte_tokenizer(directory: Path, vocab_size: int = BYTE_VOCAB) -> None:
    """A byte-level BPE tokenizer, as GPT-2's and Qwen's are: the 256 bytes, merges learned
    from a fixed text up to `vocab_size` - 3 tokens, the TOOL_MARKERS as added tokens, and
    END_TOKEN last, the special token the engine stops on. Grammars read it as they read
    a real model's."""
    if vocab_size <= 256:
        raise ValueError(f"a byte-level vocabulary needs more than 256 tokens, not {vocab_size}")
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 3,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    records = (  # enough distinct text for the merges of a bf16 test model's 1,024 tokens
        f'{{"id": {i}, "name": "item{i * 7 % 101}", "ok": {str(i % 3 == 0).lower()}}}\n'
        for i in range(2000)
    )
    backend.train_from_iterator([_BYTE_CORPUS, *records], trainer)
    if backend.get_vocab_size() != vocab_size - 3:
        raise ValueError(f"the byte-level text holds too few merges for {vocab_size} tokens")
    backend.add_tokens([AddedToken(marker, normalized=False) for marker in TOOL_MARKERS])
    backend.add_special_tokens([AddedToken(END_TOKEN, special=True, normalized=False)])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": END_TOKEN}))
    end = {"eos_token_id": vocab_size - 1}
    (directory / "generation_config.json").write_text(json.dumps(end))


def write_tiny_checkpoint(
    directory: Path,
    args: ModelArgs,
    *,
    seed: int = 0,
    tokenizer: TinyTokenizer = "none",
    eos_id: int | None = None,
    twin_gap: float | None = None,
) -> Path:
    """Write a random float64 HF checkpoint (config.json + model.safetensors) for `args`
    (see `random_hf_tensors` for `twin_gap`).

    With `tokenizer` a tokenizer.json goes beside it: "words" (implied by `eos_id`), the
    word-level `write_tiny_tokenizer`; "bytes", the byte-level `write_byte_tokenizer`.
    """
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(args), indent=2))
    tensors = random_hf_tensors(args, seed, twin_gap=twin_gap)
    save_file(tensors, str(directory / "model.safetensors"))
    if tokenizer == "bytes":
        if eos_id is not None and eos_id != args.vocab_size - 1:
            raise ValueError("a byte-level tokenizer's end token is its last id")
        write_byte_tokenizer(directory, args.vocab_size)
    elif tokenizer == "words" or eos_id is not None:
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


def tiny_checkpoint(
    args: ModelArgs,
    seed: int = 0,
    *,
    tokenizer: TinyTokenizer = "none",
    eos_id: int | None = None,
    twin_gap: float | None = None,
) -> Path:
    """`write_tiny_checkpoint` into the process cache; the returned directory is shared."""
    if tokenizer == "none" and eos_id is not None:
        tokenizer = "words"
    return _checkpoints.get(
        ("random", args, seed, tokenizer, eos_id, twin_gap),
        lambda path: write_tiny_checkpoint(
            path, args, seed=seed, tokenizer=tokenizer, eos_id=eos_id, twin_gap=twin_gap
        ),
    )


def perturbed_checkpoint(
    args: ModelArgs,
    seed: int = 0,
    *,
    noise_seed: int = 1,
    scale: float = PERTURBATION,
    tokenizer: TinyTokenizer = "none",
    eos_id: int | None = None,
    twin_gap: float | None = None,
) -> Path:
    """The cached `tiny_checkpoint(args, seed, ...)` plus noise (see `write_perturbed_copy`)."""
    base = tiny_checkpoint(args, seed, tokenizer=tokenizer, eos_id=eos_id, twin_gap=twin_gap)
    return _checkpoints.get(
        ("perturbed", base, noise_seed, scale),
        lambda path: write_perturbed_copy(base, path, seed=noise_seed, scale=scale),
    )


def flash_layout(
    checkpoint: Path, dtype: torch.dtype = torch.float64, weights: Weights = "dense"
) -> Path:
    """The flash layout of an HF checkpoint directory with weights stored as `dtype`, which
    the engine then computes in, and matrices as `weights` says (q4, q8: quantized);
    converted once per process."""
    return _layouts.get(
        ("layout", Path(checkpoint), dtype, weights),
        lambda path: convert(Path(checkpoint), path, dtype, weights=weights),
    )


@dataclass(frozen=True)
class ModelPair:
    target: Path  # flash layout (float64 unless `model_pair` was given another dtype)
    draft: Path  # HF checkpoint directory (float64)


def model_pair(
    args: ModelArgs,
    relation: Relation,
    seed: int = 0,
    *,
    draft_args: ModelArgs | None = None,
    tokenizer: TinyTokenizer = "none",
    eos_id: int | None = None,
    scale: float = PERTURBATION,
    dtype: torch.dtype = torch.float64,
    twin_gap: float | None = None,
    weights: Weights = "dense",
) -> ModelPair:
    """A target layout and a draft checkpoint, related as `relation` says:

    identical: the draft is the target's own checkpoint; perturbed: the target is the draft
    plus noise of std `scale`; independent: two unrelated random models (the draft built
    from `draft_args`, which must share the vocabulary, or `args`).
    With `tokenizer` both carry the same tokenizer (see `write_tiny_checkpoint`), and with
    `eos_id` it ends generation on that token. The target layout stores `dtype`
    and its matrices as `weights` says; with `twin_gap` every model's vocabulary comes in
    near-tied twins (`random_hf_tensors`).
    """
    tok: dict[str, Any] = dict(tokenizer=tokenizer, eos_id=eos_id, twin_gap=twin_gap)
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
    return ModelPair(target=flash_layout(target, dtype, weights), draft=draft)


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
