"""Grammars (model/grammar.py) and tool calls (text/tool_calls.py): what a grammar allows and
refuses, the engine's constrained text, and the calls read out of a model's text."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import msgspec
import pytest
import torch
import trio

from lever_actors.checkpoints.hf import load_hf
from lever_actors.checkpoints.tokenizer import Tokenizer
from lever_actors.config import EngineConfig
from lever_actors.engine import Engine
from lever_actors.errors import ConfigError
from lever_actors.model.choosing import Chooser
from lever_actors.model.grammar import Grammar
from lever_actors.model.matcher import Matcher
from lever_actors.model.sampling import GREEDY
from lever_actors.model.transformer import Transformer
from lever_actors.options import GenerationOptions
from lever_actors.policy.trees import TreeBuilder, grow_static
from lever_actors.testing import BYTE_VOCAB, TINY_ARGS, model_pair, reference_tokens
from lever_actors.text.tool_calls import CallText, call_grammar, read_calls

BYTE_ARGS = msgspec.structs.replace(TINY_ARGS, vocab_size=BYTE_VOCAB)
END = BYTE_VOCAB - 1  # the byte-level tokenizer's end token
# small enough that a random model completes it in a few dozen tokens
COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "blue"]}, "dark": {"type": "boolean"}},
    "required": ["color", "dark"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def config() -> EngineConfig:
    pair = model_pair(BYTE_ARGS, "perturbed", 0, tokenizer="bytes")
    return EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="chain:3")


@pytest.fixture(scope="module")
def tokenizer(config) -> Tokenizer:
    return Tokenizer.from_file(Path(config.target) / "tokenizer.json")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Grammar("regex", "a("), r"grammar 'regex': .*unclosed group"),
        (lambda: Grammar("lark", "start: missing"), r"grammar 'lark': .*unknown name"),
        (lambda: Grammar.json_schema({"type": 3}), r"grammar 'json_schema': type must be"),
        (lambda: Grammar.json_schema("[1, 2"), r"grammar 'json_schema': "),
        (lambda: Grammar("regex"), r"needs its source"),
        (lambda: Grammar("json", "{}"), r"any JSON \('json'\) none"),
    ],
)
def test_a_bad_grammar_is_refused_when_made(make, message):
    with pytest.raises(ConfigError, match=message) as refused:
        make()
    assert "\n" not in str(refused.value)  # one line: a log's, an HTTP 400's


def test_the_mask_allows_what_the_grammar_does_and_then_only_the_end(tokenizer):
    matcher = Matcher(
        Grammar("regex", "ab|ac"), tokenizer.grammar_vocabulary(BYTE_VOCAB), BYTE_VOCAB
    )
    allowed = matcher.allowed()
    assert allowed.shape == (BYTE_VOCAB,)
    texts = {tokenizer.decode([t]) for t in allowed.nonzero().flatten().tolist()}
    assert texts and all(t in ("a", "ab", "ac") for t in texts)
    [a] = tokenizer.encode("a")
    matcher.consume(a)
    texts = {tokenizer.decode([t]) for t in matcher.allowed().nonzero().flatten().tolist()}
    assert texts == {"b", "c"}
    [b] = tokenizer.encode("b")
    matcher.consume(b)
    assert matcher.allowed().nonzero().flatten().tolist() == [END]


def test_a_token_the_grammar_refuses_is_an_error(tokenizer):
    matcher = Matcher(Grammar("regex", "ab"), tokenizer.grammar_vocabulary(BYTE_VOCAB), BYTE_VOCAB)
    [z] = tokenizer.encode("z")
    with pytest.raises(ConfigError, match="grammar"):
        matcher.consume(z)


def test_a_word_level_tokenizer_is_refused_for_grammars():
    pair = model_pair(TINY_ARGS, "identical", 0, tokenizer="words", eos_id=3)
    words = Tokenizer.from_file(Path(pair.target) / "tokenizer.json")
    with pytest.raises(ConfigError, match="grammars cannot read this tokenizer"):
        words.grammar_vocabulary(TINY_ARGS.vocab_size)


async def test_the_engine_writes_json_valid_under_the_schema_and_as_sequential_decoding(config):
    grammar = Grammar.json_schema(COLOR)
    async with Engine.open(config) as engine:
        result = await engine.generate("Answer: ", max_new_tokens=64, grammar=grammar)
    assert result.finish_reason == "stop"  # the grammar was complete, so only the end was left
    jsonschema.validate(json.loads(result.text), COLOR)
    tokenizer = Tokenizer.from_file(Path(config.target) / "tokenizer.json")
    prompt = tokenizer.encode("Answer: ")
    assert result.tokens == reference_tokens(Path(config.target), prompt, 64, grammar=grammar)


async def test_a_grammar_needs_a_tokenizer_that_ends(config):
    pair = model_pair(TINY_ARGS, "identical", 0)
    bare = EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="none")
    async with Engine.open(bare) as engine:
        with pytest.raises(ConfigError, match="no tokenizer"):
            await engine.generate([1, 2], options=GenerationOptions(grammar=Grammar("json")))


def accepts(matcher: Matcher, tokens: list[int]) -> bool:
    """Whether the grammar allows each of `tokens` in turn."""
    for token in tokens:
        if not matcher.allowed()[token]:
            return False
        matcher.consume(token)
    return True


def test_calls_are_read_out_of_the_text_and_anything_else_stays_text():
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    content, calls = read_calls(text + '\n<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert calls[0].id != calls[1].id
    assert read_calls("no calls") == ("no calls", [])
    broken = 'x <tool_call>{"name": "f"}</tool_call>'  # no arguments: not a call
    assert read_calls(broken) == (broken, [])


def test_a_stream_holds_back_its_calls_and_lets_out_what_comes_before():
    calls = CallText()
    parts = ["Sure", ". <tool", "_call>\n", '{"name": "f", "arguments": {}}', "\n</tool_call>"]
    assert [calls.push(p) for p in parts] == ["Sure", ". ", "", "", ""]
    rest, [call] = calls.end()
    assert (rest, call.name, call.arguments) == ("", "f", "{}")
    plain = CallText()
    assert [plain.push(p) for p in ["a <to", "o"]] == ["a ", ""]
    assert plain.end() == ("<too", [])


def test_the_call_grammar_takes_one_call_or_many(tokenizer):
    """The byte-level vocabulary has the markers as tokens of their own, as Qwen's has."""
    weather = {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Rome"]}},
            "required": ["city"],
        },
    }
    vocabulary = tokenizer.grammar_vocabulary(BYTE_VOCAB)
    one = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for grammar, text, whole in [
        (call_grammar([weather], many=False, marker_tokens=True), one, True),
        (call_grammar([weather, {"name": "now"}], marker_tokens=True), one + "\n" + one, True),
        (call_grammar([weather], many=False, marker_tokens=True), one + "\n" + one, False),
        (call_grammar([weather], marker_tokens=True), one.replace("Oslo", "Paris"), False),
        (call_grammar([{"name": "now"}], marker_tokens=True), one, False),
    ]:
        matcher = Matcher(grammar, vocabulary, BYTE_VOCAB)
        assert accepts(matcher, tokenizer.encode(text)) == whole, text
    with pytest.raises(ConfigError, match="at least one tool"):
        call_grammar([])


@pytest.mark.parametrize("proposing", [None, 300])
async def test_the_draft_proposes_only_what_the_grammar_allows(config, tokenizer, proposing):
    """Every child the draft proposes is allowed after its parent's path, in a tree four
    wide and three deep: the masks of the target's choice hold for the draft's too, and
    for a draft whose logits cover only part of the vocabulary."""
    checkpoint = load_hf(Path(config.draft), torch.float64)
    model = Transformer(checkpoint.args, checkpoint.weights).proposing(proposing)
    assert model.weights.lm_head.shape[0] == (proposing or BYTE_VOCAB)
    vocabulary = tokenizer.grammar_vocabulary(BYTE_VOCAB)
    matcher = Matcher(Grammar.json_schema(COLOR), vocabulary, BYTE_VOCAB)
    chain = tokenizer.encode("Answer: ")
    builder = TreeBuilder(model, model.new_cache(64), chain, Chooser(GREEDY), matcher=matcher)
    builder.run_chain([])
    await grow_static(
        builder, (4, 4, 4), 64, lambda nodes: trio.to_thread.run_sync(builder.run, nodes)
    )
    drafted = range(builder.n_chain, len(builder.tokens))
    assert len(drafted) > 4
    for node in drafted:
        parent, path = builder.parents[node], []
        while parent >= builder.n_chain:
            path.insert(0, builder.tokens[parent])
            parent = builder.parents[parent]
        assert matcher.allowed_after(path)[builder.tokens[node]], (node, path)
