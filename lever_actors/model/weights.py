"""In-DRAM weights of one model: globals plus one dict of named tensors per layer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TypeGuard

import torch

from lever_actors.model.args import ModelArgs
from lever_actors.model.quantized import QuantizedRows, QuantizedWeight
from lever_actors.model.shapes import layer_tensor_names
from lever_actors.model.spilled import SpilledTable

# a matrix may be held quantized (model/quantized.py), a draft's table partly on disk
# (model/spilled.py); vectors are plain tensors
StoredWeight = torch.Tensor | QuantizedWeight | QuantizedRows  # as a checkpoint holds it
Weight = StoredWeight | SpilledTable
LayerTensors = dict[str, Weight]


def dense(weight: Weight) -> torch.Tensor:
    """A weight that is a plain tensor by what it is: a vector (a norm, a bias), or any
    weight of a checkpoint loaded in float."""
    assert isinstance(weight, torch.Tensor), f"a {type(weight).__name__}, not a plain tensor"
    return weight


def stored(weight: Weight) -> StoredWeight:
    """A weight of a checkpoint: never a spilled table, which only a draft's DRAM holds
    (draft.py)."""
    assert not isinstance(weight, SpilledTable), "a spilled table is not a stored weight"
    return weight


def cuts_into_rows(weight: Weight) -> TypeGuard[torch.Tensor | QuantizedWeight]:
    """Whether `row_range` takes this matrix's rows apart: a dense, int8 or q6k one (a 4-bit
    packed matrix's rows cannot be cut apart; a row-read table is not multiplied)."""
    return isinstance(weight, torch.Tensor) or (
        isinstance(weight, QuantizedWeight) and weight.rows_readable
    )


def row_range(weight: Weight, lo: int, hi: int) -> Weight:
    """Rows lo:hi of a matrix that `cuts_into_rows`, as views."""
    if cuts_into_rows(weight):
        if isinstance(weight, torch.Tensor):
            return weight[lo:hi]
        shape = (hi - lo, weight.shape[1])
        return replace(weight, shape=shape, data=weight.data[lo:hi], scales=weight.scales[lo:hi])
    raise ValueError(f"rows of a {type(weight).__name__} cannot be taken apart")


def stored_tensors(args: ModelArgs) -> Iterator[tuple[str, int | None]]:
    """(our name, layer index or None for a global) of every tensor a checkpoint stores for
    `args`, in file order: the embedding, each layer, the final norm, the LM head unless tied."""
    yield "embed", None
    for i in range(args.n_layers):
        for name in layer_tensor_names(args):
            yield name, i
    yield "final_norm", None
    if not args.tie_embeddings:
        yield "lm_head", None


@dataclass
class ModelWeights:
    """Shapes: embed/lm_head [vocab, d_model]; wq [n_heads*hd, d_model]; w_down [d_model, ffn]."""

    embed: Weight
    final_norm: torch.Tensor
    lm_head: Weight  # the same object as `embed` when the model ties them
    layers: list[LayerTensors]
    # the LM head holds the embedding's values at another precision: a tied model's own head
    # (its 4-bit row table cannot be multiplied by), or a GGUF's second copy of the table
    head_copies_embed: bool = False

    def to(self, dtype: torch.dtype) -> ModelWeights:
        """Dense tensors cast to `dtype`; quantized ones stay as they are (they compute in
        bf16, which a quantized model's dense parts then must be too)."""
        embed = _cast(self.embed, dtype)
        return ModelWeights(
            embed=embed,
            final_norm=self.final_norm.to(dtype),
            lm_head=embed if self.lm_head is self.embed else _cast(self.lm_head, dtype),
            layers=[{k: _cast(t, dtype) for k, t in layer.items()} for layer in self.layers],
            head_copies_embed=self.head_copies_embed,
        )

    def for_drafting(self) -> ModelWeights:
        """The same weights, each quantized matrix free to pick its kernel per call by rows
        (a draft's rounding only steers which tokens the target checks), and the embedding
        read from the head where the head copies it and rows can be read from it: one table
        in DRAM, not two (81 MB for the real draft)."""
        lm_head = _drafting(self.lm_head)  # a tied head is the embedding, never changed
        reads_rows = isinstance(lm_head, QuantizedWeight) and lm_head.rows_readable
        return ModelWeights(
            embed=lm_head if self.head_copies_embed and reads_rows else self.embed,
            final_norm=self.final_norm,
            lm_head=lm_head,
            layers=[{k: _drafting(t) for k, t in layer.items()} for layer in self.layers],
        )

    @property
    def nbytes(self) -> int:
        """Bytes held, a table shared by embedding and head counted once (a spilled table's
        resident rows are its head)."""
        tensors = [*_held(self.embed), self.lm_head, self.final_norm]
        tensors += [t for layer in self.layers for t in layer.values()]
        return sum({id(t): t.nbytes for t in tensors}.values())

    @property
    def quantized(self) -> bool:
        tensors = [self.embed, self.lm_head, *(t for layer in self.layers for t in layer.values())]
        return any(not isinstance(t, torch.Tensor) for t in tensors)


def _held(t: Weight) -> tuple:
    """What a weight holds in DRAM, part by part."""
    return t.held if isinstance(t, SpilledTable) else (t,)


def _cast(t: Weight, dtype: torch.dtype) -> Weight:
    return t.to(dtype) if isinstance(t, torch.Tensor) else t


def _drafting(t: Weight) -> Weight:
    return replace(t, exact=False) if isinstance(t, QuantizedWeight) else t
