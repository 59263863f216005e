"""Training the early-exit predictor: a low-rank adapter fitted by knowledge distillation.

The teacher is the target itself: for every position of some token sequences we keep the
hidden state after the exit layer and the target's final logits. The student is what the
pruner computes at run time (exit_predictor.LensPredictor): final norm + LM head rows of a
few candidate tokens applied to adapter(h_exit), softmax within the candidate set.

Candidate sets. A full-vocabulary softmax (151,936 tokens on the real target) per position
and step would cost more than everything else together, and it is not what the predictor
is asked at run time: there it scores a node's children plus a few shadow candidates, i.e.
the draft's best guesses, normalised within that set. So the distillation is restricted the
same way: per position the teacher's top `top_k` tokens (standing for the draft's guesses,
which mostly coincide with the target's) plus `n_random` other tokens drawn uniformly (so
the adapter cannot win by lifting whatever is not in the top), both distributions
normalised within the set:

    loss = T^2 * KL(softmax(z_final[set] / T) || softmax(z_pred[set] / T))

`up` starts at zero, so the untrained adapter is the identity and the student starts as
the plain lens; the report compares both on held-out sequences. Everything trains in
float32 whatever the checkpoint's dtype, and is deterministic given the seed.

Scale invariance: adapter(c*h) = c*adapter(h) and the final RMS norm ignores scale, so the
predictor's output does not depend on |h|. Training therefore uses exit states divided by
their RMS (large residual-stream norms of real models would otherwise slow the fit); the
adapter learnt applies unchanged to raw states.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F

from lever_actors.checkpoints.checkpoint import Checkpoint
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.checkpoints.tokenizer import layout_tokenizer, user_turn
from lever_actors.config import default_exit_layer
from lever_actors.device.layout import torch_dtype
from lever_actors.device.manifest import MANIFEST_NAME, read_manifest
from lever_actors.errors import ConfigError
from lever_actors.model.args import ModelArgs
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.layers import embedding, layer_forward, output_logits, rms_norm
from lever_actors.model.placement import Placement
from lever_actors.model.quantized import dense_values
from lever_actors.model.rope import Rope
from lever_actors.model.weights import stored
from lever_actors.policy.exit_predictor import PREDICTOR_FILE, LowRankAdapter
from lever_actors.progress import Progress

CHUNK = 256  # positions per LM-head pass when ranking the teacher's tokens


class TrainReport(msgspec.Struct, frozen=True):
    """What training did, with held-out figures for the plain lens and the trained adapter.

    Losses are the candidate-set KD loss above; top1: how often the student's best candidate
    is the teacher's; false_prunes: how often the teacher's best candidate scores below
    `threshold` (what the pruner would drop though full verification accepts it).
    """

    exit_layer: int
    rank: int
    steps: int
    temperature: float
    top_k: int
    n_random: int
    threshold: float
    train_sequences: int
    heldout_sequences: int
    train_positions: int
    heldout_positions: int
    lens_loss: float
    trained_loss: float
    lens_train_loss: float
    trained_train_loss: float
    lens_top1: float
    trained_top1: float
    lens_false_prunes: float
    trained_false_prunes: float
    collect_seconds: float
    train_seconds: float


@dataclass
class KDSet:
    """Distillation data of some positions (all float32 / int64).

    hidden: [n, d_model] exit-layer states divided by their RMS; candidates: [n, k] token ids;
    teacher: [n, k] the target's final logits of those tokens.
    """

    hidden: torch.Tensor
    candidates: torch.Tensor
    teacher: torch.Tensor

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def take(self, index: torch.Tensor) -> KDSet:
        return KDSet(self.hidden[index], self.candidates[index], self.teacher[index])


def train_exit_predictor(
    checkpoint: Checkpoint | str | Path,
    texts: Sequence[Sequence[int]],
    exit_layer: int | None = None,
    rank: int = 32,
    steps: int = 300,
    lr: float = 3e-3,
    temperature: float = 1.0,
    seed: int = 0,
    progress: Progress | None = None,
    *,
    continue_tokens: int = 0,
    stop_ids: frozenset[int] = frozenset(),
    top_k: int = 12,
    n_random: int = 4,
    batch_size: int = 256,
    heldout: float = 0.25,
    threshold: float = 0.02,
    dtype: torch.dtype | None = None,
) -> tuple[LowRankAdapter, TrainReport]:
    """Fit a LowRankAdapter at `exit_layer` of `checkpoint` (a loaded Checkpoint, or an HF
    directory, GGUF file or flash layout loaded whole into DRAM as `dtype`; default: the
    layout's own dtype, float32 otherwise) on the token sequences `texts`.

    With `continue_tokens` each sequence is extended by the model's own greedy continuation
    of that many tokens (ending early after a token in `stop_ids`), generated in the same
    pass and used as training data too. A `heldout` share of the sequences (at least one)
    is kept out of training for the report. `exit_layer` None: the
    engine's default (config.default_exit_layer). Returns the adapter in float32.
    """
    model = _load(checkpoint, dtype)
    args = model.args
    exit_layer = default_exit_layer(args.n_layers) if exit_layer is None else exit_layer
    if not 0 <= exit_layer < args.n_layers:
        raise ConfigError(f"exit_layer must be in [0, {args.n_layers}), got {exit_layer}")
    if not 1 <= rank <= args.d_model:
        raise ConfigError(f"rank must be in [1, {args.d_model}], got {rank}")
    texts = [list(t) for t in texts if len(t) > 0]
    if len(texts) < 2:
        raise ConfigError("training needs at least two non-empty token sequences (one held out)")
    if not 1 <= top_k + n_random <= args.vocab_size or top_k < 1 or n_random < 0:
        raise ConfigError(
            f"top_k ({top_k}) >= 1 and n_random ({n_random}) >= 0 must fit the vocabulary"
        )
    if steps < 0 or batch_size < 1 or temperature <= 0:
        raise ConfigError("steps must be >= 0, batch_size >= 1 and temperature > 0")
    generator = torch.Generator().manual_seed(seed)

    started = time.perf_counter()
    exits, finals = collect_hidden_states(
        model, texts, exit_layer, continue_tokens, stop_ids, progress
    )
    order = torch.randperm(len(texts), generator=generator).tolist()
    n_held = min(max(1, round(heldout * len(texts))), len(texts) - 1)
    held_ids, train_ids = sorted(order[:n_held]), sorted(order[n_held:])
    weights = model.weights
    # rows of the head are picked per candidate: a quantized head is unpacked once
    lm_head = dense_values(stored(weights.lm_head)).to(weights.final_norm.dtype)
    kd = {
        name: kd_set(
            torch.cat([exits[i] for i in ids]),
            torch.cat([finals[i] for i in ids]),
            weights.final_norm,
            lm_head,
            args,
            top_k,
            n_random,
            generator,
        )
        for name, ids in (("train", train_ids), ("heldout", held_ids))
    }
    collect_seconds = time.perf_counter() - started

    started = time.perf_counter()
    rows = _Rows(lm_head, weights.final_norm, args.norm_eps)
    down = torch.randn(rank, args.d_model, generator=generator) / math.sqrt(args.d_model)
    up = torch.zeros(args.d_model, rank)  # the adapter starts as the identity: the plain lens
    lens = [evaluate(kd[name], rows, None, temperature, threshold) for name in kd]
    down, up = fit(
        kd["train"], rows, down, up, steps, lr, temperature, batch_size, generator, progress
    )
    trained = [evaluate(kd[name], rows, (down, up), temperature, threshold) for name in kd]
    train_seconds = time.perf_counter() - started

    report = TrainReport(
        exit_layer=exit_layer,
        rank=rank,
        steps=steps,
        temperature=temperature,
        top_k=top_k,
        n_random=n_random,
        threshold=threshold,
        train_sequences=len(train_ids),
        heldout_sequences=len(held_ids),
        train_positions=len(kd["train"]),
        heldout_positions=len(kd["heldout"]),
        lens_loss=lens[1].loss,
        trained_loss=trained[1].loss,
        lens_train_loss=lens[0].loss,
        trained_train_loss=trained[0].loss,
        lens_top1=lens[1].top1,
        trained_top1=trained[1].top1,
        lens_false_prunes=lens[1].false_prunes,
        trained_false_prunes=trained[1].false_prunes,
        collect_seconds=collect_seconds,
        train_seconds=train_seconds,
    )
    return LowRankAdapter(down, up, exit_layer), report


def save_adapter(adapter: LowRankAdapter, path: Path) -> Path:
    """Write `adapter` to the file `path` (e.g. LAYOUT/exit_predictor.safetensors) under a
    temporary name beside it, then rename, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
        os.replace(adapter.save(tmp), path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def predictor_path(layout: Path) -> Path:
    """Where early_exit "trained"/"auto" looks for the adapter of this flash layout."""
    return Path(layout) / PREDICTOR_FILE


def chat_token_ids(layout: Path, prompts: Sequence[str]) -> tuple[list[list[int]], frozenset[int]]:
    """Each prompt as one user turn in the chat template of the layout's tokenizer, encoded;
    and the tokenizer's end tokens (where greedy continuations stop)."""
    tokenizer = layout_tokenizer(Path(layout), read_manifest(Path(layout)))
    if tokenizer is None:
        raise ConfigError(f"{layout} has no tokenizer; training on prompts needs one")
    texts = [tokenizer.encode(tokenizer.apply_chat_template(user_turn(p))) for p in prompts]
    return texts, tokenizer.eos_ids


# --- collecting (exit hidden, final hidden) pairs ---------------------------------------------


def _load(checkpoint: Checkpoint | str | Path, dtype: torch.dtype | None) -> Checkpoint:
    if isinstance(checkpoint, Checkpoint):
        return checkpoint
    path = Path(checkpoint)
    if dtype is None:
        is_layout = (path / MANIFEST_NAME).is_file()
        dtype = torch_dtype(read_manifest(path)) if is_layout else torch.float32
    return load_checkpoint(path, dtype)


@torch.inference_mode()
def collect_hidden_states(
    model: Checkpoint,
    texts: Sequence[Sequence[int]],
    exit_layer: int,
    continue_tokens: int = 0,
    stop_ids: frozenset[int] = frozenset(),
    progress: Progress | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run the model over each sequence (and its greedy continuation) -> per sequence the
    hidden states after layer `exit_layer` and after the last layer, [n_i, d_model] each.

    All sequences share one KV cache, packed one after another; a token attends to the
    earlier slots of its own sequence only, so the continuations of all sequences advance
    together, one batched forward per new token.
    """
    packed = _PackedBatch(model, sum(len(t) for t in texts) + len(texts) * continue_tokens)
    exits: list[list[torch.Tensor]] = [[] for _ in texts]
    finals: list[list[torch.Tensor]] = [[] for _ in texts]
    total = len(texts) + continue_tokens
    nexts = []
    for s, tokens in enumerate(texts):
        positions = list(range(len(tokens)))
        h_exit, h_final = packed.run(tokens, [s] * len(tokens), positions, exit_layer)
        exits[s].append(h_exit)
        finals[s].append(h_final)
        nexts.append(packed.greedy(h_final[-1:])[0])
        if progress:
            progress(s + 1, total, "exit-train: prompts")
    lengths = [len(t) for t in texts]
    active = [s for s in range(len(texts)) if nexts[s] not in stop_ids]
    for step in range(continue_tokens):
        if not active:
            break
        tokens = [nexts[s] for s in active]
        h_exit, h_final = packed.run(tokens, active, [lengths[s] for s in active], exit_layer)
        greedy = packed.greedy(h_final)
        for row, s in enumerate(active):
            exits[s].append(h_exit[row : row + 1])
            finals[s].append(h_final[row : row + 1])
            lengths[s] += 1
            nexts[s] = greedy[row]
        active = [s for s in active if nexts[s] not in stop_ids]
        if progress:
            progress(len(texts) + step + 1, total, "exit-train: continuations")
    return [torch.cat(h) for h in exits], [torch.cat(h) for h in finals]


class _PackedBatch:
    """Several sequences in one KV cache, each slot tagged with the sequence it belongs to."""

    def __init__(self, model: Checkpoint, capacity: int) -> None:
        self.args = model.args
        self.weights = model.weights
        self.dtype = model.weights.embed.dtype
        self.rope = Rope(model.args)
        self.cache = KVCache(model.args, capacity, self.dtype)
        self.slot_seqs: list[int] = []

    def run(
        self, tokens: Sequence[int], seqs: list[int], positions: list[int], exit_layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, seqs, positions: [n] each -> hidden after `exit_layer` and after the last
        layer, [n, d_model] each; the n tokens are then committed to the cache."""
        n, context = len(tokens), self.cache.length
        tags = torch.tensor(self.slot_seqs + seqs)
        slot = torch.arange(context + n)
        # mask: [n, context+n]; a token sees the slots of its sequence up to its own
        mask = (tags[None, :] == tags[context:, None]) & (slot[None, :] <= slot[context:, None])
        at = torch.tensor(positions)
        cos, sin = self.rope.tables(at, self.dtype)
        place = Placement(at, cos, sin, mask)
        x = embedding(self.weights.embed[torch.tensor(tokens)], self.args)
        h_exit = x
        for i, layer in enumerate(self.weights.layers):
            x = layer_forward(x, layer, self.args, self.cache, i, place)
            if i == exit_layer:
                h_exit = x
        self.cache.commit(n)
        self.slot_seqs += seqs
        return h_exit, x

    def greedy(self, hidden: torch.Tensor) -> list[int]:
        """hidden: [n, d_model] final states -> the n greedy next tokens."""
        w = self.weights
        logits = output_logits(hidden, w.final_norm, w.lm_head, self.args)
        return logits.argmax(-1).tolist()


@torch.no_grad()
def kd_set(
    exit_hidden: torch.Tensor,
    final_hidden: torch.Tensor,
    final_norm: torch.Tensor,
    lm_head: torch.Tensor,
    args: ModelArgs,
    top_k: int,
    n_random: int,
    generator: torch.Generator,
) -> KDSet:
    """exit_hidden, final_hidden: [n, d_model] -> the distillation data of those positions.

    The teacher's top tokens are ranked in the model's dtype (one LM-head pass per CHUNK
    positions); the logits kept for the candidate set are recomputed in float32.
    """
    candidates, teacher = [], []
    for start in range(0, final_hidden.shape[0], CHUNK):
        h = final_hidden[start : start + CHUNK]
        logits = output_logits(h, final_norm, lm_head, args)  # [chunk, vocab]
        top = logits.topk(top_k, dim=-1).indices
        # n_random distinct other tokens: the largest of uniform noise outside the top
        noise = torch.rand(logits.shape, generator=generator)
        noise.scatter_(1, top, -1.0)
        cand = torch.cat((top, noise.topk(n_random, dim=-1).indices), dim=1)  # [chunk, k]
        normed = rms_norm(h.float(), final_norm.float(), args.norm_eps)
        candidates.append(cand)
        teacher.append(torch.einsum("nkd,nd->nk", lm_head[cand].float(), normed))
    h = exit_hidden.float()
    hidden = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + args.norm_eps)
    return KDSet(hidden, torch.cat(candidates), torch.cat(teacher))


# --- fitting ------------------------------------------------------------------------------------


class _Rows:
    """The LM head rows of candidate tokens, times the final norm's weight, in float32."""

    def __init__(self, lm_head: torch.Tensor, final_norm: torch.Tensor, eps: float) -> None:
        self.lm_head = lm_head
        self.gain = final_norm.float()
        self.eps = eps

    def __call__(self, candidates: torch.Tensor) -> torch.Tensor:
        """candidates: [n, k] -> [n, k, d_model]"""
        return self.lm_head[candidates].float() * self.gain


def student_logits(
    data: KDSet, rows: _Rows, adapter: tuple[torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    """-> [n, k]: final norm + LM head rows of the candidates after the adapter (None: the
    plain lens), as LensPredictor.scores computes them before its softmax."""
    h = data.hidden
    if adapter is not None:
        down, up = adapter
        h = h + F.linear(F.linear(h, down), up)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + rows.eps)
    return torch.einsum("nkd,nd->nk", rows(data.candidates), h)


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """student, teacher: [n, k] logits -> mean over positions of T^2 * KL(teacher || student),
    both softmaxed within the set at temperature T."""
    log_p = F.log_softmax(teacher / temperature, dim=-1)
    log_q = F.log_softmax(student / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return kl.mean() * temperature**2


def fit(
    data: KDSet,
    rows: _Rows,
    down: torch.Tensor,
    up: torch.Tensor,
    steps: int,
    lr: float,
    temperature: float,
    batch_size: int,
    generator: torch.Generator,
    progress: Progress | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam on minibatches of positions, learning rate decayed on a cosine to zero."""
    down = down.clone().requires_grad_(True)
    up = up.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([down, up], lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / max(steps, 1)))
    )
    for step in range(steps):
        index = torch.randint(0, len(data), (min(batch_size, len(data)),), generator=generator)
        batch = data.take(index)
        loss = kd_loss(student_logits(batch, rows, (down, up)), batch.teacher, temperature)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if progress and ((step + 1) % 10 == 0 or step + 1 == steps):
            progress(step + 1, steps, f"exit-train: fit (loss {loss.item():.4f})")
    return down.detach(), up.detach()


@dataclass(frozen=True)
class Evaluation:
    loss: float
    top1: float
    false_prunes: float


@torch.no_grad()
def evaluate(
    data: KDSet,
    rows: _Rows,
    adapter: tuple[torch.Tensor, torch.Tensor] | None,
    temperature: float,
    threshold: float,
) -> Evaluation:
    """KD loss, top-1 agreement and false-prune rate of the student on `data`."""
    if len(data) == 0:
        return Evaluation(float("nan"), float("nan"), float("nan"))
    loss = top1 = false = 0.0
    for start in range(0, len(data), CHUNK):
        batch = data.take(torch.arange(start, min(start + CHUNK, len(data))))
        student = student_logits(batch, rows, adapter)
        n = len(batch)
        loss += kd_loss(student, batch.teacher, temperature).item() * n
        best = batch.teacher.argmax(-1, keepdim=True)
        top1 += (student.argmax(-1, keepdim=True) == best).sum().item()
        scores = torch.softmax(student, dim=-1).gather(1, best)
        false += (scores < threshold).sum().item()
    return Evaluation(loss / len(data), top1 / len(data), false / len(data))
