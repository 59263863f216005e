"""Token trees, the KV cache's commit/keep, and the core of tree verification: one pass over
a whole tree with the tree mask gives every node the hidden state of its own path as a chain."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from lever_actors.checkpoints.hf import load_hf
from lever_actors.errors import ConfigError
from lever_actors.model.kv_cache import KVCache
from lever_actors.model.placement import tree_placement
from lever_actors.model.transformer import Transformer
from lever_actors.model.tree import TokenTree
from lever_actors.testing import TINY_ARGS, bf16_args, write_tiny_checkpoint
from tests.tiny_hf import ARCHS, save_tiny, tiny_model

#          0
#          |
#          1
#        /   \
#       2     3
#      / \     \
#     4   5     6
#     |
#     7
PARENTS = (-1, 0, 1, 1, 2, 2, 3, 4)
TOKENS = (10, 11, 12, 13, 14, 15, 16, 17)
DEPTHS = (0, 1, 2, 2, 3, 3, 3, 4)
ANCESTORS = {  # node -> itself and its ancestors
    0: {0},
    1: {0, 1},
    2: {0, 1, 2},
    3: {0, 1, 3},
    4: {0, 1, 2, 4},
    5: {0, 1, 2, 5},
    6: {0, 1, 3, 6},
    7: {0, 1, 2, 4, 7},
}


@pytest.fixture
def tree() -> TokenTree:
    return TokenTree(TOKENS, PARENTS)


# ---------------------------------------------------------------------------- TokenTree


def test_depths_and_positions(tree):
    assert len(tree) == 8
    assert tree.depths == DEPTHS
    assert tree.positions(0).tolist() == list(DEPTHS)
    positions = tree.positions(5)
    assert positions.dtype == torch.int64
    assert positions.tolist() == [5 + d for d in DEPTHS]


def test_ancestry_marks_exactly_self_and_ancestors(tree):
    ancestry = tree.ancestry()
    assert ancestry.shape == (8, 8) and ancestry.dtype == torch.bool
    for node in range(8):
        assert set(torch.nonzero(ancestry[node]).flatten().tolist()) == ANCESTORS[node]


@pytest.mark.parametrize("context", [0, 1, 6])
def test_attention_mask_sees_context_and_ancestors_only(tree, context):
    mask = tree.attention_mask(context)
    assert mask.shape == (8, context + 8) and mask.dtype == torch.bool
    for node in range(8):
        assert mask[node, :context].all()  # the committed context is always visible
        seen = {j for j in range(8) if mask[node, context + j]}
        assert seen == ANCESTORS[node]


def test_children(tree):
    assert tree.children(0) == [1]
    assert tree.children(1) == [2, 3]
    assert tree.children(2) == [4, 5]
    assert tree.children(3) == [6]
    assert tree.children(4) == [7]
    for leaf in (5, 6, 7):
        assert tree.children(leaf) == []


def test_path_to(tree):
    assert tree.path_to(0) == [0]
    assert tree.path_to(7) == [0, 1, 2, 4, 7]
    assert tree.path_to(6) == [0, 1, 3, 6]
    for node in range(8):
        assert set(tree.path_to(node)) == ANCESTORS[node]
        path = tree.path_to(node)
        assert [tree.depths[n] for n in path] == list(range(len(path)))


def test_without_drops_descendants(tree):
    assert tree.without([]) == [True] * 8
    assert tree.without([2]) == [True, True, False, True, False, False, True, False]
    assert tree.without([4, 6]) == [True, True, True, True, False, True, False, False]
    assert tree.without([3, 2]) == [True, True, False, False, False, False, False, False]
    assert tree.without([7]) == [True] * 7 + [False]
    assert tree.without([0]) == [False] * 8


def test_chain():
    chain = TokenTree.chain([5, 6, 7, 8])
    assert chain.parents == (-1, 0, 1, 2)
    assert chain.depths == (0, 1, 2, 3)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.equal(chain.attention_mask(0), causal)
    assert chain.path_to(3) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "parents",
    [
        pytest.param((0, 0), id="first-node-has-a-parent"),
        pytest.param((-1, -1), id="two-roots"),
        pytest.param((-1, 1), id="own-parent"),
        pytest.param((-1, 2, 0), id="parent-after-child"),
        pytest.param((-1, 0, 5), id="parent-out-of-range"),
        pytest.param((-1, 0, -2), id="negative-parent"),
        pytest.param((-1, -3), id="negative-parent-before-any"),
    ],
)
def test_invalid_parents_rejected(parents):
    with pytest.raises(ValueError, match="parent"):
        TokenTree(tuple(range(len(parents))), parents)


def test_tokens_and_parents_must_have_the_same_length():
    with pytest.raises(ValueError, match="parents"):
        TokenTree((1, 2, 3), (-1, 0))


# ---------------------------------------------------------------------------- KVCache

ARGS = msgspec.structs.replace(TINY_ARGS, n_layers=3, n_kv_heads=2)  # tests name layer 2, head 1


def entries(first: float, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v: [n_kv_heads, n, head_dim], every entry distinct; token j's values derive from
    first + j so they can be recognised after moving."""
    ids = first + torch.arange(n, dtype=torch.float64)
    base = ids[None, :, None] + 0.01 * torch.arange(ARGS.n_kv_heads)[:, None, None]
    k = base + 0.001 * torch.arange(ARGS.head_dim)[None, None, :]
    return k, -k


def filled(length: int, capacity: int = 16) -> KVCache:
    """A cache whose committed prefix holds tokens 0..length-1 (k = token id + ...)."""
    cache = KVCache(ARGS, capacity, torch.float64)
    k, v = entries(0.0, length)
    for layer in range(ARGS.n_layers):
        cache.write(layer, k + 100 * layer, v - 100 * layer)
    cache.commit(length)
    return cache


def test_write_stores_at_the_end_and_returns_context_plus_block():
    cache = filled(3)
    assert cache.length == 3
    k, v = entries(50.0, 2)
    keys, values = cache.write(1, k, v)
    assert keys.shape == values.shape == (ARGS.n_kv_heads, 5, ARGS.head_dim)
    prefix_k, prefix_v = entries(0.0, 3)
    assert torch.equal(keys[:, :3], prefix_k + 100)
    assert torch.equal(values[:, :3], prefix_v - 100)
    assert torch.equal(keys[:, 3:], k) and torch.equal(values[:, 3:], v)
    assert cache.length == 3  # nothing is committed by a write


def test_write_with_offsets_and_span():
    cache = filled(2)
    k, v = entries(50.0, 3)
    offsets = torch.tensor([4, 0, 2])
    keys, values = cache.write(0, k, v, offsets, span=6)
    assert keys.shape == (ARGS.n_kv_heads, 2 + 6, ARGS.head_dim)
    for row, offset in enumerate(offsets.tolist()):
        assert torch.equal(keys[:, 2 + offset], k[:, row])
        assert torch.equal(values[:, 2 + offset], v[:, row])
    untouched = [1, 3, 5]
    assert torch.equal(keys[:, [2 + o for o in untouched]], torch.zeros(2, 3, ARGS.head_dim))
    assert torch.equal(keys[:, :2], entries(0.0, 2)[0])  # the context is left alone


def pending_block(cache: KVCache, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write n pending tokens (values from 50 up) at every layer. -> what was written."""
    k, v = entries(50.0, n)
    for layer in range(ARGS.n_layers):
        cache.write(layer, k + 100 * layer, v - 100 * layer)
    return k, v


@pytest.mark.parametrize(
    "kept",
    [
        pytest.param([1, 3, 4], id="non-contiguous"),
        pytest.param([2, 3, 4], id="overlapping-shift"),
        pytest.param([0, 2, 5], id="starts-at-zero"),
        pytest.param([5], id="last-only"),
        pytest.param([0, 1, 2], id="prefix"),
        pytest.param([], id="nothing"),
    ],
)
def test_keep_packs_exactly_the_kept_entries_after_the_prefix(kept):
    cache = filled(3)
    k, v = pending_block(cache, 6)
    cache.keep(kept)
    assert cache.length == 3 + len(kept)
    prefix_k, prefix_v = entries(0.0, 3)
    for layer in range(ARGS.n_layers):
        assert torch.equal(cache.keys[layer, :, :3], prefix_k + 100 * layer)
        assert torch.equal(cache.values[layer, :, :3], prefix_v - 100 * layer)
        got_k = cache.keys[layer, :, 3 : 3 + len(kept)]
        got_v = cache.values[layer, :, 3 : 3 + len(kept)]
        assert torch.equal(got_k, k[:, kept] + 100 * layer)
        assert torch.equal(got_v, v[:, kept] - 100 * layer)


def test_keep_then_continue_sees_the_kept_entries():
    cache = filled(3)
    k, _ = pending_block(cache, 4)
    cache.keep([0, 3])
    nxt, nxt_v = entries(90.0, 1)
    keys, _ = cache.write(0, nxt, nxt_v)
    assert keys.shape[1] == 3 + 2 + 1
    assert torch.equal(keys[:, 3:5], k[:, [0, 3]])
    assert torch.equal(keys[:, 5:], nxt)


def test_keep_moves_still_pending_entries_behind_the_kept_ones():
    """A subtree drafted ahead stays pending, packed right after the committed path."""
    cache = filled(3)
    k, v = pending_block(cache, 7)
    cache.keep([1, 4], pending=[6, 2, 5])
    assert cache.length == 3 + 2
    for layer in range(ARGS.n_layers):
        got_k = cache.keys[layer, :, 3:8]
        got_v = cache.values[layer, :, 3:8]
        assert torch.equal(got_k, k[:, [1, 4, 6, 2, 5]] + 100 * layer)
        assert torch.equal(got_v, v[:, [1, 4, 6, 2, 5]] - 100 * layer)


def test_commit_keeps_every_pending_entry_in_order():
    cache = filled(2)
    k, v = pending_block(cache, 3)
    cache.commit(3)
    assert cache.length == 5
    assert torch.equal(cache.keys[2, :, 2:5], k + 200)
    assert torch.equal(cache.values[0, :, 2:5], v)


def test_truncate():
    cache = filled(5)
    cache.truncate(5)
    assert cache.length == 5
    cache.truncate(2)
    assert cache.length == 2
    k, v = entries(70.0, 1)
    keys, _ = cache.write(0, k, v)
    assert keys.shape[1] == 3 and torch.equal(keys[:, 2], k[:, 0])
    cache.truncate(0)
    assert cache.length == 0
    with pytest.raises(ValueError):
        cache.truncate(1)
    with pytest.raises(ValueError):
        cache.truncate(-1)


def test_capacity_error():
    cache = filled(6, capacity=8)
    k, v = entries(50.0, 3)
    with pytest.raises(ConfigError, match="KV cache full"):
        cache.write(0, k, v)
    with pytest.raises(ConfigError, match="KV cache full"):
        cache.write(0, k[:, :1], v[:, :1], torch.tensor([0]), span=3)
    keys, _ = cache.write(0, k[:, :2], v[:, :2])  # exactly full is fine
    assert keys.shape[1] == 8


# ------------------------------------------------------- tree verification == chains


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory) -> Transformer:
    hf = save_tiny(tiny_model(request.param, seed=3, layers=3), tmp_path_factory.mktemp("hf") / "m")
    checkpoint = load_hf(hf, torch.float64)
    return Transformer(checkpoint.args, checkpoint.weights)


PROMPT = [3, 14, 15, 92, 65, 35]


def chain_hidden(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """Final hidden state of the last token, the whole sequence run as a plain chain."""
    cache = model.new_cache(len(tokens))
    return model.forward(torch.tensor(tokens), cache)[-1]


@pytest.mark.parametrize("context", [0, 1, len(PROMPT)])
def test_tree_pass_equals_each_path_as_a_chain(model, context):
    tree = TokenTree(TOKENS, PARENTS)
    cache = model.new_cache(context + len(tree))
    if context:
        model.forward(torch.tensor(PROMPT[:context]), cache)
        cache.commit(context)
    place = tree_placement(model.rope, context, tree, model.dtype)
    hidden = model.forward(torch.tensor(tree.tokens), cache, place)  # [n, d_model]
    assert hidden.dtype == torch.float64
    for node in range(len(tree)):
        path = [tree.tokens[n] for n in tree.path_to(node)]
        expected = chain_hidden(model, PROMPT[:context] + path)
        torch.testing.assert_close(hidden[node], expected, rtol=1e-10, atol=1e-10)


def test_keeping_a_path_equals_having_decoded_it_as_a_chain(model):
    """The commit after verification: keep the accepted path's KV entries, then continue."""
    tree = TokenTree(TOKENS, PARENTS)
    cache = model.new_cache(len(PROMPT) + len(tree) + 1)
    model.forward(torch.tensor(PROMPT), cache)
    cache.commit(len(PROMPT))
    place = tree_placement(model.rope, cache.length, tree, model.dtype)
    model.forward(torch.tensor(tree.tokens), cache, place)
    path = tree.path_to(5)  # [0, 1, 2, 5]: not a prefix of the pending block
    cache.keep(path)
    assert cache.length == len(PROMPT) + len(path)

    accepted = PROMPT + [tree.tokens[n] for n in path]
    reference = model.new_cache(len(accepted) + 1)
    model.forward(torch.tensor(accepted), reference)
    reference.commit(len(accepted))
    torch.testing.assert_close(
        cache.keys[:, :, : cache.length],
        reference.keys[:, :, : len(accepted)],
        rtol=1e-10,
        atol=1e-10,
    )
    torch.testing.assert_close(
        cache.values[:, :, : cache.length],
        reference.values[:, :, : len(accepted)],
        rtol=1e-10,
        atol=1e-10,
    )
    nxt = torch.tensor([42])
    torch.testing.assert_close(
        model.forward(nxt, cache)[-1], chain_hidden(model, accepted + [42]), rtol=1e-10, atol=1e-10
    )


def test_a_subset_of_rows_equals_the_whole_tree_for_those_rows(model):
    """What the verifier does after pruning: later layers run only the surviving nodes."""
    tree = TokenTree(TOKENS, PARENTS)
    alive = tree.without([2])
    live = torch.tensor([i for i, a in enumerate(alive) if a])
    cache = model.new_cache(len(PROMPT) + len(tree))
    model.forward(torch.tensor(PROMPT), cache)
    cache.commit(len(PROMPT))
    place = tree_placement(model.rope, cache.length, tree, model.dtype).rows(live)
    hidden = model.forward(torch.tensor(tree.tokens)[live], cache, place)
    for row, node in enumerate(live.tolist()):
        path = [tree.tokens[n] for n in tree.path_to(node)]
        torch.testing.assert_close(
            hidden[row], chain_hidden(model, PROMPT + path), rtol=1e-10, atol=1e-10
        )


# --------------------------------------------- bf16: verification == decoding, bit for bit


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Transformer:
    """Heads of 128 dims as in the real pair, and matrices of 512 and more inputs: below
    that neither the attention nor the matrix kernels' row-count switches show."""
    args = msgspec.structs.replace(bf16_args("qwen2"), n_layers=2)
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "b", args, seed=1)
    checkpoint = load_hf(directory, torch.bfloat16)
    return Transformer(checkpoint.args, checkpoint.weights)


LONG_PROMPT = [(7 * i + 3) % 128 for i in range(40)]


def decoded_one_at_a_time(model: Transformer, prompt: list[int], path: list[int]):
    """Prefill the prompt, then decode `path` one token per forward: -> the last hidden."""
    cache = model.new_cache(len(prompt) + len(path))
    hidden = model.forward(torch.tensor(prompt), cache)
    cache.commit(len(prompt))
    for token in path:
        hidden = model.forward(torch.tensor([token]), cache)
        cache.commit(1)
    return hidden[-1]


def one_token_states(model: Transformer, prompt: list[int], tree: TokenTree) -> torch.Tensor:
    """Every node's final hidden state when its path is decoded one token per forward after
    the prompt (depth first, the cache rolled back between siblings). -> [len(tree), d_model]"""
    cache = model.new_cache(len(prompt) + max(tree.depths) + 1)
    model.forward(torch.tensor(prompt), cache)
    cache.commit(len(prompt))
    states = [torch.empty(0)] * len(tree)

    def visit(node: int) -> None:
        length = cache.length
        states[node] = model.forward(torch.tensor([tree.tokens[node]]), cache)[0]
        cache.commit(1)
        for child in tree.children(node):
            visit(child)
        cache.truncate(length)

    visit(0)
    return torch.stack(states)


def random_tree(n: int, seed: int, vocab: int = 1024, max_depth: int = 5) -> TokenTree:
    rng = random.Random(seed)
    parents, depths = [-1], [0]
    for _ in range(1, n):
        parent = rng.choice([i for i, d in enumerate(depths) if d < max_depth])
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return TokenTree(tuple(rng.randrange(vocab) for _ in range(n)), tuple(parents))


@pytest.mark.parametrize("n_nodes", [1, 2, 7, 31, 32, 33, 64, 65, 130, 200])
def test_in_bf16_a_tree_pass_equals_one_token_decoding_bit_for_bit(bf16_model, n_nodes):
    """Rounding must not depend on how many rows or masked columns come along, or a
    near-tie would let verification choose another token than sequential greedy."""
    model = bf16_model
    tree = random_tree(n_nodes, seed=n_nodes)
    cache = model.new_cache(len(LONG_PROMPT) + len(tree))
    model.forward(torch.tensor(LONG_PROMPT), cache)
    cache.commit(len(LONG_PROMPT))
    place = tree_placement(model.rope, cache.length, tree, model.dtype)
    hidden = model.forward(torch.tensor(tree.tokens), cache, place)
    expected = one_token_states(model, LONG_PROMPT, tree)
    differing = [node for node in range(len(tree)) if not torch.equal(hidden[node], expected[node])]
    assert not differing, f"nodes whose state differs from one-token decoding: {differing}"
    logits = model.logits(hidden)
    alone = torch.cat([model.logits(expected[node : node + 1]) for node in range(len(tree))])
    assert torch.equal(logits, alone)


def test_in_bf16_a_prompt_verified_with_a_tree_equals_its_prefill_bit_for_bit(bf16_model):
    """Step 0 runs the prompt and the first draft tree in one pass."""
    model = bf16_model
    n = len(LONG_PROMPT)
    parents = tuple(range(-1, n - 1)) + tuple(p + n if p >= 0 else n - 1 for p in PARENTS)
    tree = TokenTree(tuple(LONG_PROMPT) + TOKENS, parents)
    hidden = model.forward(
        torch.tensor(tree.tokens),
        model.new_cache(len(tree)),
        tree_placement(model.rope, 0, tree, model.dtype),
    )
    prefill = model.forward(torch.tensor(LONG_PROMPT), model.new_cache(n))
    assert torch.equal(hidden[:n], prefill)
    for node in range(n, len(tree)):
        path = [tree.tokens[i] for i in tree.path_to(node)[n:]]
        assert torch.equal(hidden[node], decoded_one_at_a_time(model, LONG_PROMPT, path))
