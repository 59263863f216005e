"""The engine's public API: streamed events, generate() statistics, early exit and
cancellation, actor failures surfacing as themselves, bad input refused before any work,
message traces and channel statistics."""

from __future__ import annotations

import gc
import math
import re
import threading
import time
import weakref
from collections import Counter
from contextlib import aclosing
from pathlib import Path

import msgspec
import pytest
import tokenizers
import torch
import trio
from tokenizers import decoders, models

from lever_actors.actors import verifier
from lever_actors.actors.drafter import Drafter
from lever_actors.actors.projector import Projector
from lever_actors.actors.verifier import Verifier
from lever_actors.channels.messages import (
    Commit,
    DraftRequest,
    DraftRound,
    DraftTree,
    ExitProbe,
    FinalHidden,
    LayerWeights,
    LeaveSeat,
    PruneVerdict,
    SlotRelease,
    TakeSeat,
    Verdict,
)
from lever_actors.channels.trace import TraceRecord, read_trace
from lever_actors.checkpoints.convert import convert
from lever_actors.checkpoints.hf import load_hf
from lever_actors.config import DEFAULT_TREE, ChannelSizes, EngineConfig, TreeSpec
from lever_actors.device.budget import minimum_budget
from lever_actors.device.manifest import read_manifest
from lever_actors.engine import Engine
from lever_actors.errors import ConfigError, ConsumerStalledError, DeadlineError
from lever_actors.model.sampling import Sampling
from lever_actors.model.sequential import sequential_reference
from lever_actors.model.transformer import Transformer
from lever_actors.testing import TINY_ARGS, model_pair
from lever_actors.testing.oracle import assert_matches_sequential, reference_tokens
from tests.tiny_hf import save_tiny, tiny_model
from tests.torch_ops import OpsOnThisThread

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
NEW = 12
N_LAYERS = 4
TIMEOUT = 30  # seconds, for anything a test awaits: generous on a busy 2-core machine
# 95 printable ASCII characters + newline + tab = the tiny models' 97-token vocabulary
CHARS = "".join(chr(c) for c in range(32, 127)) + "\n\t"


def write_tokenizer(directory: Path, chars: str) -> None:
    """A character-level tokenizer.json: one token per character, id = position in `chars`."""
    backend = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    backend.decoder = decoders.Fuse()
    backend.save(str(directory / "tokenizer.json"))


class Models:
    """Everything the tests open engines on, built once per module."""

    def __init__(self, root: Path) -> None:
        target = tiny_model("llama", seed=0, layers=N_LAYERS)
        self.target_hf = save_tiny(target, root / "target")
        write_tokenizer(self.target_hf, CHARS)
        self.layout = root / "layout"
        convert(self.target_hf, self.layout, torch.float64)
        manifest = read_manifest(self.layout)
        # layer 0 resident, the other layers streamed through the ring: slots are used
        self.budget = minimum_budget(manifest) + manifest.layer(0).nbytes

        # a draft that agrees with the target often but not always: the target, perturbed
        with torch.no_grad():
            for p in target.parameters():
                p.add_(0.08 * torch.randn_like(p))
        self.draft_hf = save_tiny(target, root / "draft")
        write_tokenizer(self.draft_hf, CHARS)

        self.other_vocab_hf = save_tiny(
            tiny_model("llama", seed=1, layers=2, vocab=101), root / "v"
        )
        write_tokenizer(self.other_vocab_hf, CHARS + "éß日本")  # the target's, and four more
        self.other_tokenizer_hf = save_tiny(tiny_model("llama", seed=1, layers=2), root / "t")
        write_tokenizer(self.other_tokenizer_hf, CHARS[::-1])  # same size, other mapping

        reference = load_hf(self.target_hf, torch.float64)
        self.model = Transformer(reference.args, reference.weights)
        self.tokenizer = reference.tokenizer
        self.expected = sequential_reference(self.model, PROMPT, 40)

    def config(self, **overrides) -> EngineConfig:
        settings = dict(
            target=str(self.layout),
            draft=str(self.draft_hf),
            draft_dtype="float64",
            dram_budget=self.budget,
            tree="chain:3",
            early_exit="probe_only",
        )
        return EngineConfig(**(settings | overrides))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Models:
    return Models(tmp_path_factory.mktemp("engine_api"))


async def collect(engine: Engine, prompt=PROMPT, n: int = NEW, **kw) -> list:
    with trio.fail_after(TIMEOUT):
        return [event async for event in engine.stream(prompt, max_new_tokens=n, **kw)]


async def generate(engine: Engine, prompt=PROMPT, n: int = NEW, **kw):
    with trio.fail_after(TIMEOUT):
        return await engine.generate(prompt, max_new_tokens=n, **kw)


# ------------------------------------------------------------------ streaming and results


async def test_stream_events_carry_token_text_step_origin_and_time(tiny):
    async with Engine.open(tiny.config()) as engine:
        events = await collect(engine)
    tokens = [e.token for e in events]
    assert tokens == tiny.expected[:NEW]
    assert "".join(e.text for e in events) == tiny.tokenizer.decode(tokens)
    for e in events:
        assert e.text == CHARS[e.token]  # one character per token, delivered with it
    steps = [e.step for e in events]
    assert steps[0] == 0 and steps == sorted(steps)
    assert set(steps) == set(range(steps[-1] + 1))  # every step emits at least one token
    times = [e.elapsed_seconds for e in events]
    assert times[0] >= 0 and times == sorted(times)
    for step in set(steps):
        origin = [e.from_draft for e in events if e.step == step]
        # accepted draft tokens first, then the target's own bonus token (cut short only
        # when max_new_tokens is reached mid-step)
        drafted = origin.count(True)
        assert origin[:drafted] == [True] * drafted
        assert origin[drafted:] in ([False], []) and drafted <= 3
        if step != steps[-1]:
            assert origin[-1] is False


async def test_an_identical_draft_is_always_accepted(tiny):
    async with Engine.open(tiny.config(draft=str(tiny.target_hf))) as engine:
        events = await collect(engine)
        result = await generate(engine)
    assert [e.token for e in events] == result.tokens == tiny.expected[:NEW]
    assert [e.from_draft for e in events] == [True, True, True, False] * (NEW // 4)
    assert [e.step for e in events] == [s for s in range(NEW // 4) for _ in range(4)]
    assert len(result.steps) == NEW // 4
    assert result.mean_accepted == 4.0
    assert all(s.new_tokens == 4 for s in result.steps)


async def test_generate_returns_tokens_text_and_step_statistics(tiny):
    async with Engine.open(tiny.config()) as engine:
        result = await generate(engine, n=20)
    assert result.tokens == tiny.expected[:20]
    assert result.text == tiny.tokenizer.decode(result.tokens)
    steps = result.steps
    assert [s.step for s in steps] == list(range(len(steps)))
    assert sum(s.new_tokens for s in steps) >= 20
    assert sum(s.new_tokens for s in steps[:-1]) < 20
    assert 1 <= len(steps) <= 20
    assert result.mean_accepted == pytest.approx(sum(s.new_tokens for s in steps) / len(steps))
    assert 1.0 <= result.mean_accepted <= 4.0
    assert steps[0].tree_nodes == len(PROMPT) + 3  # the prompt, then chain:3
    for s in steps[1:]:
        assert s.tree_nodes == 1 + 3  # last step's bonus token, then chain:3
    for s in steps:
        assert s.live_nodes == s.tree_nodes and s.pruned == 0  # early_exit probe_only keeps all
        assert 1 <= s.new_tokens <= 4
        for seconds in (s.draft_seconds, s.io_wait_seconds, s.verify_seconds, s.project_seconds):
            assert seconds >= 0
        assert s.step_seconds > 0
    assert result.prefill_seconds > 0 and result.decode_seconds > 0
    assert result.decode_tokens_per_second > 0


async def test_a_text_prompt_is_tokenized_and_stop_strings_end_the_request(tiny):
    text = "def f(x):"
    ids = tiny.tokenizer.encode(text)
    assert len(ids) == len(text)
    expected = sequential_reference(tiny.model, ids, 20)
    full = tiny.tokenizer.decode(expected)
    stop = full[5:7]
    cut = next(k for k in range(1, 21) if stop in tiny.tokenizer.decode(expected[:k]))
    async with Engine.open(tiny.config()) as engine:
        assert (await generate(engine, text, 20)).tokens == expected
        result = await generate(engine, text, 20, stop=[stop])
        kept = await generate(engine, text, 20, stop=[stop], keep_stop=True)
    assert result.tokens == kept.tokens == expected[:cut]
    assert result.text == full[: full.index(stop)]  # as OpenAI's: the stop string left out
    assert kept.text == tiny.tokenizer.decode(expected[:cut])


# -------------------------------------------------------- leaving early, cancellation


async def test_breaking_out_of_the_loop_stops_the_request(tiny):
    async with Engine.open(tiny.config()) as engine:
        with trio.fail_after(TIMEOUT):
            # closing the generator explicitly (what `aclosing` does) cancels at once
            async with aclosing(engine.stream(PROMPT, max_new_tokens=30)) as events:
                async for event in events:
                    if event.token == tiny.expected[2] and event.elapsed_seconds >= 0:
                        break
            # a bare `break`: trio finalizes the abandoned generator, which cancels it too
            seen = 0
            async for _ in engine.stream(PROMPT, max_new_tokens=30):
                seen += 1
                if seen == 3:
                    break
        assert (await generate(engine)).tokens == tiny.expected[:NEW]
        assert engine.npu.running == engine.cpu.running == 0


async def test_cancelling_the_callers_scope_stops_the_request(tiny):
    async with Engine.open(tiny.config()) as engine:
        with trio.fail_after(TIMEOUT):
            with trio.CancelScope() as scope:
                async for event in engine.stream(PROMPT, max_new_tokens=30):
                    if event.step == 1:
                        scope.cancel()
            assert scope.cancelled_caught
            with trio.move_on_after(0.02) as timer:
                await engine.generate(PROMPT, max_new_tokens=200)  # takes far longer
            assert timer.cancelled_caught
        result = await generate(engine)
        assert result.tokens == tiny.expected[:NEW]
        assert engine.npu.running == engine.cpu.running == 0


async def test_a_request_waiting_behind_another_gets_its_own_tokens(tiny):
    other_prompt = [1, 2, 3]
    other_expected = sequential_reference(tiny.model, other_prompt, NEW)
    results = {}
    async with Engine.open(tiny.config()) as engine:
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:

                async def run(name, prompt):
                    results[name] = (await engine.generate(prompt, max_new_tokens=NEW)).tokens

                nursery.start_soon(run, "a", PROMPT)
                nursery.start_soon(run, "b", other_prompt)
    assert results == {"a": tiny.expected[:NEW], "b": other_expected}


async def test_a_closed_engine_holds_no_weights_while_its_object_lives_on(tiny):
    async with Engine.open(tiny.config()) as engine:
        await generate(engine)
        draft = weakref.ref(engine.draft)
        resident_layer = weakref.ref(next(iter(engine.target.resident_layers.values()))["wq"])
    gc.collect()
    assert draft() is None and resident_layer() is None
    assert engine.tokenizer is not None  # what a caller may still read: text, statistics
    assert engine.policies.spec.kind == "chain"


async def test_a_draft_proposing_from_part_of_the_vocabulary_changes_no_token(tiny):
    sampling = Sampling(temperature=0.8, seed=5)
    sampled = reference_tokens(tiny.layout, PROMPT, NEW, sampling=sampling)
    async with Engine.open(tiny.config(draft_vocabulary=40)) as engine:
        assert engine.draft.weights.lm_head.shape[0] == 40  # its logits: ids 0-39 alone
        assert (await generate(engine)).tokens == tiny.expected[:NEW]
        result = await generate(engine, temperature=0.8, seed=5)
        assert result.tokens == sampled


def test_a_model_proposing_from_part_of_the_vocabulary_keeps_those_logits(tiny):
    whole = tiny.model
    hidden = torch.randn(3, whole.args.d_model, dtype=torch.float64)
    assert whole.proposing(None) is whole and whole.proposing(10_000) is whole
    part = whole.proposing(40)
    assert part.weights.embed is whole.weights.embed  # tokens beyond 40 are still read
    torch.testing.assert_close(part.logits(hidden), whole.logits(hidden)[:, :40])


@pytest.mark.parametrize("units", ["split", "single"])
async def test_an_engine_computes_on_its_units_threads_and_ends_them_when_closed(
    tiny, units, tmp_path
):
    """Never on the event loop's: a product there would start a second OpenMP team, and
    every team would then sleep after each product (device/units.py). Spilling the prompt
    cache at the close is compute too."""
    config = tiny.config(
        units=units, tree="gaincost", draft_ahead=True, prompt_cache_dir=str(tmp_path)
    )
    with OpsOnThisThread() as ops:
        async with Engine.open(config) as engine:
            assert (await generate(engine)).tokens == tiny.expected[:NEW]
            await generate(engine, temperature=0.8, seed=5)
            threads = {engine.npu._thread, engine.cpu._thread}
    assert ops.computed == []
    assert list(tmp_path.glob("*/*.kv"))  # spilled, on a unit's thread
    assert len(threads) == (2 if units == "split" else 1)
    assert {t.name for t in threads} <= {"lever-npu", "lever-cpu"}
    assert not any(t.is_alive() for t in threads)


# ------------------------------------------------------------------- failure injection


class Injected(Exception):
    """Raised by a fault planted in one actor."""


# Trio keeps finished worker threads in a process-wide cache for reuse (each exits after
# about ten idle seconds), so threads can outlive a request without doing anything. Trio
# starts them as daemon threads named "Trio thread N"; while one runs a job trio renames it
# to "<function> from <task>", and it restores "Trio thread N" before handing the result
# back. So a daemon thread bearing exactly that default name is an idle cached worker.
IDLE_TRIO_WORKER = re.compile(r"Trio thread \d+")
ENGINE_UNIT = re.compile(r"lever-(npu|cpu)")


def leftover_threads(before: set[threading.Thread]) -> list[str]:
    """Every thread besides the main one, except idle trio workers and daemon threads that
    were already there before the engine opened (and are not running a trio job now)."""
    left = []
    for thread in threading.enumerate():
        if thread is threading.main_thread():
            continue
        if thread.daemon and IDLE_TRIO_WORKER.fullmatch(thread.name):
            continue  # idle in trio's cache
        if thread.daemon and thread in before and " from " not in thread.name:
            continue  # someone else's, from before this engine
        if ENGINE_UNIT.fullmatch(thread.name):
            continue  # an open engine's own compute unit (idle: the callers check `running`)
        left.append(f"{thread.name!r} (daemon={thread.daemon})")
    return left


class Fault:
    """A one-shot fault: raises Injected the first time its condition holds."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.message = f"injected into the {where} on step 2"
        self.armed = True
        self.calls = 0

    def fire(self, condition: bool) -> None:
        if self.armed and condition:
            self.armed = False
            raise Injected(self.message)


def plant(where: str, engine: Engine, monkeypatch) -> Fault:
    fault = Fault(where)
    if where == "verifier":
        verify = Verifier._verify

        async def failing_verify(self, batch, *args):
            fault.fire(self.passes == 2)
            return await verify(self, batch, *args)

        monkeypatch.setattr(Verifier, "_verify", failing_verify)
    elif where == "verifier layer":
        import lever_actors.actors.verifier as verifier_module

        layer_forward = verifier_module.batch_layers_forward

        def failing_layer(*args):  # runs in a worker thread: step 2, layer 2
            fault.calls += 1
            fault.fire(fault.calls == 2 * N_LAYERS + 3)
            return layer_forward(*args)

        monkeypatch.setattr(verifier_module, "batch_layers_forward", failing_layer)
    elif where == "projector":
        walk = Projector.walk

        def failing_walk(self, final):
            fault.fire(final.step == 2)
            return walk(self, final)

        monkeypatch.setattr(Projector, "walk", failing_walk)
    elif where == "drafter":
        draft = Drafter.draft

        async def failing_draft(self, request):
            fault.fire(request.step == 2)
            return await draft(self, request)

        monkeypatch.setattr(Drafter, "draft", failing_draft)
    elif where == "pruner":
        prune = engine.policies.prune

        def failing_prune(probe):
            fault.fire(probe.step == 2)
            return prune(probe)

        monkeypatch.setattr(engine.policies, "prune", failing_prune)
    elif where == "prefetcher":
        read_extent = engine.target.store.read_extent
        streamed = len(engine.target.plan.streamed_layers)

        def failing_read(extent, buffer, **options):
            fault.calls += 1
            fault.fire(fault.calls == 2 * streamed + 1)  # the first read of pass 2
            return read_extent(extent, buffer, **options)

        monkeypatch.setattr(engine.target.store, "read_extent", failing_read)
    else:
        raise AssertionError(where)
    return fault


FAULTS = ["verifier", "verifier layer", "projector", "drafter", "pruner", "prefetcher"]


@pytest.mark.parametrize("jitter", [0.0, 0.002])
@pytest.mark.parametrize("where", FAULTS)
@pytest.mark.parametrize("api", ["stream", "generate"])
async def test_an_actor_error_surfaces_as_itself_and_leaves_nothing_running(
    tiny, monkeypatch, api, where, jitter
):
    before = set(threading.enumerate())
    async with Engine.open(tiny.config(jitter_seconds=jitter)) as engine:
        fault = plant(where, engine, monkeypatch)
        events = []
        with trio.fail_after(TIMEOUT):
            with pytest.raises(Exception) as raised:  # noqa: PT011 - checked exactly below
                if api == "stream":
                    async for event in engine.stream(PROMPT, max_new_tokens=30):
                        events.append(event)
                else:
                    await engine.generate(PROMPT, max_new_tokens=30)
        # the original exception, not a group wrapping it, nor a secondary error
        assert type(raised.value) is Injected, repr(raised.value)
        assert str(raised.value) == fault.message
        assert not fault.armed
        assert [e.token for e in events] == tiny.expected[: len(events)]
        with trio.fail_after(TIMEOUT):  # the shared actors wind down once no request is left
            await engine.crew.ended()
        assert engine.npu.running == engine.cpu.running == 0  # no compute job still going
        assert leftover_threads(before) == []
        # the engine survives: the next request runs clean
        assert (await generate(engine)).tokens == tiny.expected[:NEW]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("prompt", "n", "message"),
    [
        pytest.param([], NEW, "the prompt is empty", id="empty-ids"),
        pytest.param("", NEW, "the prompt is empty", id="empty-text"),
        pytest.param(list(range(97)) * 3, 1, "exceeds the context of 256 tokens", id="too-long"),
        pytest.param([1] * 250, 7, "exceeds the context of 256 tokens", id="too-long-with-new"),
        pytest.param(PROMPT, 0, "max_new_tokens must be positive", id="zero-new"),
        pytest.param(PROMPT, -3, "max_new_tokens must be positive", id="negative-new"),
        pytest.param([1, 97], NEW, r"token ids must be in \[0, 97\)", id="id-too-big"),
        pytest.param([-1, 5], NEW, r"token ids must be in \[0, 97\)", id="id-negative"),
    ],
)
async def test_bad_requests_fail_before_any_work(tiny, prompt, n, message):
    async with Engine.open(tiny.config()) as engine:
        reads = engine.target.store.stats.bytes_read
        jobs = (engine.npu.jobs, engine.cpu.jobs)  # the loading's
        with trio.fail_after(TIMEOUT):
            with pytest.raises(ConfigError, match=message):
                await engine.generate(prompt, max_new_tokens=n)
            with pytest.raises(ConfigError, match=message):
                async for _ in engine.stream(prompt, max_new_tokens=n):
                    pass
        assert engine.channels is None  # no request was ever wired up
        assert (engine.npu.jobs, engine.cpu.jobs) == jobs
        assert engine.target.store.stats.bytes_read == reads
        assert (await generate(engine)).tokens == tiny.expected[:NEW]


async def test_a_request_filling_the_context_exactly_works(tiny):
    prompt = [(7 * i) % 97 for i in range(250)]
    async with Engine.open(tiny.config(tree="static:2,2")) as engine:
        result = await generate(engine, prompt, 6)
    assert result.tokens == sequential_reference(tiny.model, prompt, 6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param({"tree": "tree:3"}, "cannot read tree", id="unknown-kind"),
        pytest.param({"tree": "chain:x"}, "cannot read tree", id="not-a-number"),
        pytest.param({"tree": "static:"}, "cannot read tree", id="no-widths"),
        pytest.param({"tree": "chain:0"}, "at least 1", id="zero-chain"),
        pytest.param({"tree": "static:2,0"}, "at least 1", id="zero-width"),
        pytest.param({"tree": "chain:2,3"}, "chain takes one length", id="chain-two-numbers"),
        pytest.param(
            {"tree": "chain:100000"}, "has 100000 draft nodes; at most 1024", id="huge-chain"
        ),
        pytest.param({"tree": "static:65"}, "a static width is at most 64", id="wide-static"),
        pytest.param(
            {"tree": "static:1000,1000,1000"},
            "has 1001001000 draft nodes; at most 1024",
            id="huge-static",
        ),
        pytest.param({"tree": "gaincost:5000"}, "has 5000 draft nodes", id="huge-gaincost"),
        pytest.param({"ring_slots": 1}, "ring_slots = 1: expected `int` >= 2", id="one-slot"),
        pytest.param({"ring_slots": 0}, "ring_slots = 0: expected `int` >= 2", id="no-slots"),
        pytest.param({"draft": None}, "needs a draft model", id="no-draft"),
        pytest.param(
            {"draft_dtype": "int8"}, "draft_dtype = 'int8': expected one of", id="draft-dtype"
        ),
        pytest.param(
            {"prune_when": "never"}, "prune_when = 'never': expected one of", id="prune-when"
        ),
        pytest.param(
            lambda: {"channels": ChannelSizes(finals=0)}, "channel finals = 0", id="channel-0"
        ),
    ],
)
async def test_bad_configs_fail_before_anything_is_loaded(tiny, overrides, message):
    # the target does not exist: only a check made before loading can give this error
    missing = str(tiny.layout.parent / "missing")
    with trio.fail_after(TIMEOUT):
        with pytest.raises(ConfigError, match=message):
            settings = overrides() if callable(overrides) else overrides
            async with Engine.open(tiny.config(target=missing, **settings)):
                pytest.fail("the engine opened")


async def test_a_draft_with_another_vocabulary_size_is_refused(tiny):
    message = (
        f"draft {tiny.other_vocab_hf} has 101 tokens, the target 97; first difference at "
        "id 97: 'é' in the draft, no token in the target: "
        "speculative decoding needs the same tokenizer"
    )
    with trio.fail_after(TIMEOUT):
        with pytest.raises(ConfigError, match=re.escape(message)):
            async with Engine.open(tiny.config(draft=str(tiny.other_vocab_hf))):
                pytest.fail("the engine opened")


async def test_a_draft_with_another_tokenizer_is_refused(tiny):
    # same size, other mapping: CHARS reversed puts its last character, a tab, at id 0
    message = (
        f"draft {tiny.other_tokenizer_hf} has 97 tokens, the target 97; first difference at "
        "id 0: '\\t' in the draft, ' ' in the target: "
        "speculative decoding needs the same tokenizer"
    )
    with trio.fail_after(TIMEOUT):
        with pytest.raises(ConfigError, match=re.escape(message)):
            async with Engine.open(tiny.config(draft=str(tiny.other_tokenizer_hf))):
                pytest.fail("the engine opened")


async def test_a_draft_without_a_tokenizer_is_judged_by_its_size(tiny, tmp_path):
    draft = save_tiny(tiny_model("llama", seed=1, layers=2, vocab=101), tmp_path / "bare")
    message = (
        f"draft {draft} has 101 tokens, the target 97: "
        "speculative decoding needs the same tokenizer"
    )
    with trio.fail_after(TIMEOUT):
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
            async with Engine.open(tiny.config(draft=str(draft))):
                pytest.fail("the engine opened")


async def test_a_static_tree_wider_than_the_vocabulary_is_refused_or_capped(tiny):
    """Asking every node for more children than there are tokens cannot be drafted as
    asked: the engine must say so when it opens, or draft what exists; not crash mid-step."""
    with trio.fail_after(TIMEOUT):
        try:
            async with Engine.open(tiny.config(tree="static:100")) as engine:
                result = await engine.generate(PROMPT, max_new_tokens=4)
        except ConfigError:
            return
    assert result.tokens == tiny.expected[:4]


# ------------------------------------------------------------------ trace and statistics

MESSAGE_CHANNELS = {
    DraftRequest: {"requests"},
    DraftTree: {"arrivals"},
    TakeSeat: {"arrivals"},
    LeaveSeat: {"arrivals"},
    DraftRound: {"arrivals"},
    LayerWeights: {"layers"},
    SlotRelease: {"releases"},
    ExitProbe: {"probes"},
    PruneVerdict: {"prune_verdicts"},
    FinalHidden: {"finals"},
    Verdict: {"verdicts"},
    Commit: {"draft_commits", "verify_commits"},
}


def is_tensor_summary(value, shape=None) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"shape", "dtype"}
        and value["dtype"] == "float64"
        and (shape is None or value["shape"] == list(shape))
    )


async def test_the_trace_holds_every_message_of_every_step_as_typed_structs(tiny, tmp_path):
    path = tmp_path / "trace.jsonl"
    async with Engine.open(tiny.config(trace=str(path))) as engine:
        result = await generate(engine)
    assert engine.tracer.file.closed  # with the engine
    records = read_trace(path)
    assert records and all(isinstance(r, TraceRecord) for r in records)
    seconds = [r.seconds for r in records]
    assert seconds == sorted(seconds) and seconds[0] >= 0
    kinds = Counter(type(r.message) for r in records)
    assert set(kinds) == set(MESSAGE_CHANNELS)  # every message type of a step
    for r in records:
        assert r.channel in MESSAGE_CHANNELS[type(r.message)]

    n_steps = len(result.steps)
    by_type = {kind: [r.message for r in records if type(r.message) is kind] for kind in kinds}
    for kind in (DraftRequest, DraftTree, ExitProbe, PruneVerdict, FinalHidden, Verdict):
        assert [m.step for m in by_type[kind]] == list(range(n_steps)), kind.__name__
    commits = [r for r in records if type(r.message) is Commit]
    for channel in ("draft_commits", "verify_commits"):
        steps = [r.message.step for r in commits if r.channel == channel]
        assert steps == list(range(n_steps))  # the last step too: the caches keep its path
    tokens = [t for v in by_type[Verdict] for t in v.tokens]
    assert tokens[:NEW] == result.tokens

    d_model = tiny.model.args.d_model
    for probe in by_type[ExitProbe]:
        assert isinstance(probe.tree, DraftTree)
        assert is_tensor_summary(probe.hidden, (len(probe.nodes), d_model))
    for final in by_type[FinalHidden]:
        assert isinstance(final.tree, DraftTree)
        assert is_tensor_summary(final.hidden, (len(final.nodes), d_model))
    [seat] = by_type[TakeSeat]
    [leave] = by_type[LeaveSeat]
    assert seat.seat == leave.seat == 0 and seat.cache == "KVCache"  # objects: named only
    assert all(tree.seat == 0 for tree in by_type[DraftTree])
    layers = by_type[LayerWeights]
    for m in layers:
        # one layer resident (the streamed ones spread through the pass), the rest streamed:
        # each a message of its own
        assert [m.first] == list(m.layers) and (m.slot is None) == (m.first == 1)
        assert all(is_tensor_summary(t) for tensors in m.tensors for t in tensors.values())
    assert {m.first for m in layers} == set(range(N_LAYERS))
    released = [m.slot for m in by_type[SlotRelease]]
    assert len(released) == (N_LAYERS - 1) * n_steps


async def test_channel_statistics_are_exposed(tiny):
    sizes = ChannelSizes(requests=2, probes=1, prune_verdicts=2, finals=2, commits=3, verdicts=2)
    config = tiny.config(channels=sizes, ring_slots=3, parallel=2)
    async with Engine.open(config) as engine:
        assert engine.channels is engine.crew.channels is None
        await generate(engine)
        with trio.fail_after(TIMEOUT):
            await engine.crew.ended()  # the shared actors wind down once no request is left
        stats = engine.channels.statistics() | engine.crew.channels.statistics()
    capacities = {
        "requests": 2,
        "arrivals": 4 * 2,  # a seat, a tree, a step aside and a leaving for each request
        "layers": 3,
        "releases": 3,
        "probes": 1,
        "prune_verdicts": 2,
        "finals": 2,
        "verdicts": 2,
        "draft_commits": 3,
        "verify_commits": 3,
    }
    assert {name: s.max_buffer_size for name, s in stats.items()} == capacities
    for name, s in stats.items():
        # the request is over: every actor closed its ends and nobody is left waiting
        assert s.open_send_channels == s.open_receive_channels == 0, name
        assert s.tasks_waiting_send == s.tasks_waiting_receive == 0, name
        assert not math.isinf(s.max_buffer_size)


async def test_the_trace_of_a_request_left_early_is_complete_and_closed(tiny, tmp_path):
    path = tmp_path / "trace.jsonl"
    async with Engine.open(tiny.config(trace=str(path))) as engine:
        seen = []
        with trio.fail_after(TIMEOUT):
            async with aclosing(engine.stream(PROMPT, max_new_tokens=60)) as events:
                async for event in events:
                    seen.append(event)
                    if event.step == 3:
                        break
            channels = engine.channels
            while any(  # the request winds down in the background: wait for its end
                s.open_send_channels or s.open_receive_channels
                for s in channels.statistics().values()
            ):
                await trio.sleep(0.01)
    assert channels.tracer.file.closed, "the trace file is left open"
    records = read_trace(path)
    verdict_steps = [r.message.step for r in records if type(r.message) is Verdict]
    # every step whose tokens the consumer saw is in the trace
    assert verdict_steps[: seen[-1].step + 1] == list(range(seen[-1].step + 1))
    assert [type(r.message) for r in records].count(LeaveSeat) == 1  # it left the batch


async def test_a_target_alone_decodes_one_token_per_pass(tiny):
    config = EngineConfig(target=str(tiny.layout))  # no draft, no tree named
    assert config.tree == TreeSpec("none")
    assert EngineConfig(target="t", draft="d").tree == DEFAULT_TREE
    with trio.fail_after(TIMEOUT):
        result = await assert_matches_sequential(config, PROMPT, 6)
    assert result.mean_accepted == 1.0


async def test_a_deadline_stops_a_prompts_pass_at_the_next_layer(monkeypatch):
    """#64 item 10: a deadline could not stop a prefill pass already running (504 after
    3.6 s for a 0.5 s deadline). A prompt's pass takes its layers a job each, and a request
    that left is dropped at the next: here 8 layers of 0.25 s each, a 0.3 s deadline."""
    args = msgspec.structs.replace(TINY_ARGS, n_layers=8, max_seq_len=512)
    pair = model_pair(args, "perturbed", 0)
    config = EngineConfig(target=str(pair.target), draft=str(pair.draft), tree="chain:2")
    first, apply = verifier._first_layers, verifier._apply_layers

    def compute(batch, layers) -> None:  # a prompt's layers' compute, in the unit's thread
        if sum(len(t.tree) for t in batch) > 100:
            time.sleep(0.25 * len(layers))

    def slow_first(target, batch, layers):
        compute(batch, layers)
        return first(target, batch, layers)

    def slow(batch, layers, *rest):
        compute(batch, layers)
        return apply(batch, layers, *rest)

    monkeypatch.setattr(verifier, "_first_layers", slow_first)
    monkeypatch.setattr(verifier, "_apply_layers", slow)
    prompt = [1 + i % 30 for i in range(300)]
    with trio.fail_after(60):
        async with Engine.open(config) as engine:
            started = trio.current_time()
            with pytest.raises(DeadlineError):
                await engine.generate(prompt, max_new_tokens=3, deadline_seconds=0.3)
            ended = trio.current_time() - started
            after = await engine.generate([4, 5], max_new_tokens=3)  # the engine goes on
    assert ended < 1.2  # the deadline and the layer running then; the pass takes 2 s
    assert len(after.tokens) == 3


async def test_a_stalled_consumer_is_ended_and_the_next_request_runs():
    """A stream whose reader stops taking tokens (its buffer full) is ended after
    `stall_seconds`; the reader, back, hears why its request ended."""
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(
        target=str(pair.target),
        draft=str(pair.draft),
        tree="chain:2",
        stall_seconds=0.5,
        channels=ChannelSizes(events=1),
        jitter_seconds=0.05,  # 200 tokens: tens of seconds
    )
    taken = []
    with trio.fail_after(60):
        async with Engine.open(config) as engine:
            stalled = engine.stream([1, 2, 3], max_new_tokens=200)
            taken.append(await anext(stalled))  # then it takes no more for a while
            started = trio.current_time()
            after = await engine.generate([4, 5], max_new_tokens=3)
            waited = trio.current_time() - started
            await trio.sleep(1)  # past the stall: the other request no longer waits for it
            with pytest.raises(ConsumerStalledError, match="no token was taken for 0.5 s"):
                async for event in stalled:
                    taken.append(event)
    assert len(after.tokens) == 3
    assert waited < 5  # the second request's own run
    assert len(taken) <= 1 + 2  # what the buffer and the step held when it was ended


async def test_a_reader_that_stops_holds_up_no_other_request():
    """#64 E4: a pass waited for every seated request's tree, so a stream whose reader
    stopped froze the others in its batch until `stall_seconds` ended it. It steps aside
    now: the other request runs to its end meanwhile, and the stopped one, read again,
    goes on to the same tokens as alone."""
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    config = EngineConfig(
        target=str(pair.target),
        draft=str(pair.draft),
        tree="chain:2",
        parallel=2,
        stall_seconds=30,
        channels=ChannelSizes(events=1),
    )
    with trio.fail_after(60):
        async with Engine.open(config) as engine:
            alone = [(await engine.generate(p, max_new_tokens=24)).tokens for p in ([1, 2], [4])]
            stopped = engine.stream([1, 2], max_new_tokens=24)
            taken = [(await anext(stopped)).token]  # then it takes none for a while
            started = trio.current_time()
            other = await engine.generate([4], max_new_tokens=24)
            waited = trio.current_time() - started
            taken += [event.token async for event in stopped]
    assert waited < 10  # it waited for the stall's 30 s before
    assert [taken, other.tokens] == alone


async def test_a_deadline_ends_the_request_at_the_step_it_passes_in():
    """After its first token, a request's deadline is soft: the step that ends after it is
    the last, "length", its tokens the sequential ones, cut short; before it (waiting for
    the engine, or in the prefill) the request is cancelled with DeadlineError, and the
    request it waited behind runs on untouched."""
    pair = model_pair(TINY_ARGS, "perturbed", 0)
    prompt = [3, 14, 15, 9, 6, 5]  # the tiny pair's vocabulary is 32 tokens
    config = EngineConfig(
        target=str(pair.target),
        draft=str(pair.draft),
        tree="chain:2",
        jitter_seconds=0.05,
        parallel=1,  # the second request waits behind the first
    )
    with trio.fail_after(60):
        async with Engine.open(config) as engine:
            started = trio.current_time()
            cut = await engine.generate(prompt, max_new_tokens=240, deadline_seconds=1.0)
            took = trio.current_time() - started
            long = engine.stream([1, 2, 3], max_new_tokens=40)
            first = await anext(long)
            with pytest.raises(DeadlineError, match="no token within the deadline of 0.2 s"):
                await engine.generate([4, 5], max_new_tokens=3, deadline_seconds=0.2)
            rest = [event async for event in long]
            with pytest.raises(DeadlineError):  # alone, but its prefill takes longer
                await engine.generate(prompt, max_new_tokens=3, deadline_seconds=1e-3)
    assert cut.finish_reason == "length"
    assert 0 < len(cut.tokens) < 240
    assert 1.0 <= took < 1.0 + 5  # a step of jitter at most, on a busy machine
    assert cut.tokens == reference_tokens(pair.target, prompt, len(cut.tokens))
    waited = [first.token] + [e.token for e in rest]
    assert waited == reference_tokens(pair.target, [1, 2, 3], 40)
    assert rest[-1].finish_reason == "length"
