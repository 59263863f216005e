"""Which format each tensor is stored in, and the quantization into it.

`--weights` choices: "dense" keeps every tensor in the layout's dtype; "auto" keeps a GGUF
file's own precision class (Q4_K -> q4k and Q6_K -> q6k, their own values; other 4- and 5-bit
types -> q4k too, 8-bit types -> int8, float types dense; an HF checkpoint stays dense); "q4",
"q4k", "q6" and "q8" quantize every matrix. Norms and biases always stay dense; the embedding
table becomes int4rows where its class is 4-bit, else stays dense. A shape a format cannot
take falls back to int8.
Q4_K and Q6_K blocks keep their values (q4k in our packing, q6k as stored), and Q4_K converts
to int4 without requantizing (its 32-input groups are int4's; only the scales round to bf16);
other types are dequantized and rounded to nearest. The other 4- and 5-bit types take q4k,
not int4, for speed: the real draft's Q5_0 matrices (896 inputs, a last block half padded)
multiplied 2-8 rows 1.4-2x as fast on AVX2 (docs/benchmarks.md); int4's AMX tiles are faster
for big trees, which `--weights q4` keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec
import torch
import torch.nn.functional as F

from lever_actors.checkpoints.checkpoint import Checkpoint
from lever_actors.config import WEIGHTS_CHOICES, Weights
from lever_actors.errors import ConfigError
from lever_actors.model.args import ModelArgs
from lever_actors.model.formats import GROUP, K_INPUTS, Format, check_quantizable, q4k_blocks_of
from lever_actors.model.quantized import (
    COMPUTE_DTYPE,
    QuantizedRows,
    QuantizedWeight,
    from_groups,
    pack_q4k,
    q4k_blocks,
    quantize_int4,
    quantize_int8,
)
from lever_actors.model.shapes import is_norm
from lever_actors.model.weights import ModelWeights, Weight, dense

SAMPLED_ROWS = 64  # of an embedding table, compared with an LM head's

_FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS")
_EIGHT_BIT = ("Q8_0", "Q8_1", "Q8_K")


def check_choice(weights: str, dtype: torch.dtype) -> Weights:
    if weights not in WEIGHTS_CHOICES:
        raise ConfigError(f"weights {weights!r}: expected one of {', '.join(WEIGHTS_CHOICES)}")
    if weights != "dense" and dtype != COMPUTE_DTYPE:
        raise ConfigError(f"quantized weights compute in bfloat16, not {dtype}")
    return weights  # type: ignore[return-value]


def tensor_format(
    choice: Weights, ours: str, shape: tuple[int, ...], source_type: str | None = None
) -> Format:
    """The format tensor `ours` of this shape is kept in; `source_type` is the GGUF type name
    it is stored as (None for float sources)."""
    if choice == "dense" or len(shape) != 2 or is_norm(ours):
        return "dense"
    if choice == "auto":
        if source_type in _FOUR_BIT:
            choice = "q4k"
        elif source_type == "Q6_K":
            choice = "q6"
        elif source_type in _EIGHT_BIT:
            choice = "q8"
        else:
            return "dense"
    if ours == "embed":
        return (
            "int4rows"
            if choice in ("q4", "q4k") and check_quantizable(shape, "int4rows") is None
            else "dense"
        )
    if choice == "q4k" and check_quantizable(shape, "q4k") is None:
        return "q4k"
    if choice == "q4" and check_quantizable(shape, "int4") is None:
        return "int4"
    if choice == "q6" and check_quantizable(shape, "q6k") is None:
        return "q6k"
    return "int8"


def quantize_tensor(values: torch.Tensor, fmt: Format, dtype: torch.dtype) -> Weight:
    """A float tensor in format `fmt` (dense: cast to `dtype`)."""
    if fmt == "dense":
        return values.to(dtype)
    if fmt == "int8":
        return quantize_int8(values)
    if fmt == "q6k":
        return quantize_q6k(values)
    if fmt == "q4k":
        return quantize_q4k(values)
    return quantize_int4(values, fmt)  # type: ignore[arg-type]


def quantize_q6k(w: torch.Tensor) -> QuantizedWeight:
    """Round to nearest into Q6_K blocks: each 16 inputs' scale is max |w| / 31, held as an
    int8 multiple of the block's float16 d (its largest scale / 127); q - 32 in -32..31."""
    out, inputs = w.shape
    blocks = inputs // K_INPUTS
    groups = w.float().view(out, blocks, 16, 16)
    wanted = groups.abs().amax(-1) / 31  # [out, blocks, 16]
    d = (wanted.amax(-1) / 127).to(torch.float16)  # [out, blocks]
    sc = torch.where(d[..., None] > 0, wanted / d.float()[..., None], 0.0).round().clamp(-128, 127)
    step = (d.float()[..., None] * sc)[..., None]  # the scale the kernels multiply by
    safe = torch.where(step > 0, step, 1.0)
    q = torch.where(step > 0, groups / safe, 0.0).round_().clamp_(-32, 31).to(torch.uint8) + 32
    q = q.view(out, blocks, 2, 2, 2, 32)  # [half, nibble, run, byte]: q6k_values' order
    low = q & 15
    ql = (low[:, :, :, 0] | low[:, :, :, 1] << 4).reshape(out, blocks, 128)
    high = (q >> 4).to(torch.int32)
    shifts = torch.tensor([0, 2, 4, 6]).view(1, 1, 1, 2, 2, 1)  # [nibble, run]: 2 * (2n + r)
    qh = (high << shifts).sum((3, 4)).to(torch.uint8).reshape(out, blocks, 64)
    stored = torch.cat((ql, qh, sc.to(torch.int8).view(torch.uint8)), dim=-1)
    return QuantizedWeight("q6k", (out, inputs), stored.reshape(out, -1).contiguous(), d)


def quantize_q4k(w: torch.Tensor) -> QuantizedWeight:
    """Round to nearest into Q4_K's values: each 32 inputs' range, from min(w, 0) to max(w),
    in 16 steps; its step and -min(w, 0) held as 6-bit multiples of each 256 inputs' float16
    d and dmin (their largest / 63). A last block short of K_INPUTS is padded with zeros."""
    out, inputs = w.shape
    blocks = q4k_blocks_of(inputs)
    padded = F.pad(w.float(), (0, blocks * K_INPUTS - inputs))
    groups = padded.view(out, blocks, 8, 32)
    floor = -groups.amin(-1).clamp_max(0)  # [out, blocks, 8], at least 0
    wanted = (groups.amax(-1) + floor) / 15
    d, dmin = ((t.amax(-1) / 63).to(torch.float16) for t in (wanted, floor))  # [out, blocks]

    def in_units(t: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
        unit = unit.float()[..., None]
        return torch.where(unit > 0, t / torch.where(unit > 0, unit, 1.0), 0.0).round().clamp(0, 63)

    sc, m = in_units(wanted, d), in_units(floor, dmin)
    step = (d.float()[..., None] * sc)[..., None]  # what the kernels multiply by
    shifted = groups + (dmin.float()[..., None] * m)[..., None]
    q = torch.where(step > 0, shifted / torch.where(step > 0, step, 1.0), 0.0)
    q = q.round_().clamp_(0, 15).view(out, blocks * K_INPUTS)
    return pack_q4k(q, sc.to(torch.uint8), m.to(torch.uint8), d, dmin, inputs)


# formats that quantize each row on its own, so a matrix may arrive a chunk of rows at a time
ROW_WISE_FORMATS = ("int8", "q6k", "int4rows")


def quantize_by_rows(chunks: Iterable[torch.Tensor], fmt: Format, shape: tuple[int, int]) -> Weight:
    """A matrix in a ROW_WISE_FORMATS format from its rows in chunks ([rows, in] float each):
    only one chunk is ever held in float (545 MB whole for the draft's head), and each is
    written into the result as it comes (a list of parts to join would double the peak)."""
    whole: list[torch.Tensor] = []  # int8, q6k: data, scales; int4rows: records
    filled = 0
    for chunk in chunks:
        part = quantize_tensor(chunk, fmt, COMPUTE_DTYPE)
        pieces = (part.records,) if isinstance(part, QuantizedRows) else (part.data, part.scales)  # type: ignore[union-attr]
        if not whole:
            whole = [torch.empty((shape[0], *p.shape[1:]), dtype=p.dtype) for p in pieces]
        for into, piece in zip(whole, pieces, strict=True):
            into[filled : filled + len(piece)] = piece
        filled += len(pieces[0])
    if fmt == "int4rows":
        return QuantizedRows(shape, *whole)
    return QuantizedWeight(fmt, shape, *whole)  # type: ignore[arg-type]


def quantize_checkpoint(checkpoint: Checkpoint, choice: Weights) -> Checkpoint:
    """A checkpoint loaded in float (an HF one) with its matrices in `choice`'s formats."""
    args, w = checkpoint.args, checkpoint.weights

    def convert(ours: str, t: Weight) -> Weight:
        t = dense(t)  # loaded in float
        return quantize_tensor(t, tensor_format(choice, ours, tuple(t.shape)), COMPUTE_DTYPE)

    embed = convert("embed", w.embed)
    tied = args.tie_embeddings
    if tied:
        args, lm_head = tied_head(args, embed, lambda: convert("lm_head", w.embed))
    else:
        lm_head = convert("lm_head", w.lm_head)
    weights = ModelWeights(
        embed=embed,
        final_norm=w.final_norm.to(COMPUTE_DTYPE),
        lm_head=lm_head,
        layers=[{name: convert(name, t) for name, t in layer.items()} for layer in w.layers],
        head_copies_embed=tied and lm_head is not embed,
    )
    return Checkpoint(args, weights, checkpoint.tokenizer, checkpoint.source)


def tied_head(
    args: ModelArgs, embed: Weight, own_head: Callable[[], Weight]
) -> tuple[ModelArgs, Weight]:
    """The LM head of a tied model: the embedding table itself, unless that is a 4-bit
    table read by rows, which cannot be multiplied by; the model then gets a head of its
    own, `own_head()` (the same values in the LM head's format), and is untied."""
    if isinstance(embed, torch.Tensor):
        return args, embed
    return msgspec.structs.replace(args, tie_embeddings=False), own_head()


def copies_embedding(embed: Weight, head: Weight) -> bool:
    """Whether an LM head holds the embedding's values at another precision, as where a GGUF
    stores a tied model's table twice (the real draft: a Q5_0 table, held in 4 bits, and a
    Q8_0 head; they differ by 9% in norm). Judged on evenly spaced rows: within 25%, where
    two unrelated matrices of one scale differ by 141%. A 4-bit packed head's rows cannot be
    read, so it never counts."""
    if embed.shape != head.shape or (isinstance(head, QuantizedWeight) and not head.rows_readable):
        return False
    ids = torch.linspace(0, embed.shape[0] - 1, SAMPLED_ROWS).long()
    table, rows = embed[ids].float(), head[ids].float()
    return bool(torch.linalg.norm(table - rows) <= 0.25 * torch.linalg.norm(table))


def q4k_to_int4(blocks: torch.Tensor, shape: tuple[int, int], fmt: Format) -> Weight:
    """GGUF Q4_K blocks of a [out, in] matrix (see `q4k_blocks`) in a 4-bit format of ours:
    value = d * sc * q - dmin * m per group of 32, which is (q - 8) * scale + zero with
    scale = d * sc, zero = 8 * scale - dmin * m."""
    out, inputs = shape
    q, sc, m, d, dmin = q4k_blocks(blocks, shape)
    scale = d.float()[..., None] * sc.float()  # [out, blocks, 8]
    zero = 8 * scale - dmin.float()[..., None] * m.float()
    groups = (out, inputs // GROUP)
    return from_groups(q.to(torch.int32), scale.reshape(groups), zero.reshape(groups), fmt)  # type: ignore[arg-type]
