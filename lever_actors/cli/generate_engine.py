"""`generate` on torch: the engine's pipeline (the real pair by default), or a model held
whole in DRAM (--model)."""

from __future__ import annotations

import argparse
import sys
import time

import trio

from lever_actors.channels.messages import TokenEvent
from lever_actors.channels.stats import decode_phase, decode_rate, per_step, prefill_rate
from lever_actors.checkpoints.load import load_checkpoint
from lever_actors.cli.engine_config import engine_config
from lever_actors.cli.generate_output import Summary, streamed
from lever_actors.config import EngineConfig, check_request_size
from lever_actors.device.layout import DTYPE_NAMES
from lever_actors.device.memory import peak_rss_bytes
from lever_actors.engine import Engine
from lever_actors.errors import ConfigError
from lever_actors.model.sequential import sequential_stream
from lever_actors.model.transformer import Transformer
from lever_actors.options import GenerationOptions
from lever_actors.progress import ProgressLine
from lever_actors.sizes import format_bytes


def generate_in_memory(
    args: argparse.Namespace,
    prompt: str | None,
    messages: list[dict] | None,
    options: GenerationOptions,
) -> Summary:
    started = time.perf_counter()
    checkpoint = load_checkpoint(args.model, DTYPE_NAMES[args.dtype])
    tokenizer = checkpoint.tokenizer
    if tokenizer is None:
        raise ConfigError(f"{args.model} has no tokenizer; generate needs one to encode text")
    text = prompt if messages is None else tokenizer.apply_chat_template(messages)
    assert text is not None  # _what_to_continue gives a prompt or messages
    ids = tokenizer.encode(text)
    check_request_size(len(ids), options.max_new_tokens, checkpoint.args.max_seq_len)
    model = Transformer(checkpoint.args, checkpoint.weights)
    print(f"loaded {args.model.name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    stream = sequential_stream(
        model, ids, options.max_new_tokens, tokenizer.eos_ids, options.sampling
    )
    return streamed(stream, tokenizer, ids, options)


def generate_with_engine(
    args: argparse.Namespace,
    prompt: str | None,
    messages: list[dict] | None,
    options: GenerationOptions,
) -> Summary:
    """The pipeline: the target streamed from flash, the draft in DRAM."""
    config = engine_config(args)
    return trio.run(_stream_from_engine, config, prompt, messages, options)


async def _stream_from_engine(
    config: EngineConfig,
    prompt: str | None,
    messages: list[dict] | None,
    options: GenerationOptions,
) -> Summary:
    started = time.perf_counter()
    async with Engine.open(config, progress=ProgressLine(unit="")) as engine:
        target, plan = engine.target, engine.target.plan
        if engine.tokenizer is None:
            raise ConfigError(f"{config.target} has no tokenizer; generate needs one")
        loaded = time.perf_counter() - started
        print(
            f"loaded in {loaded:.1f} s ({engine.load_times}); {engine.context}; "
            f"tree {engine.config.tree}, "
            f"{len(plan.streamed_layers)}/{target.args.n_layers} target layers streamed "
            f"({target.store.mode}), {format_bytes(plan.used(target.manifest))} of target "
            "weights in DRAM",
            file=sys.stderr,
        )
        print(engine.plan, file=sys.stderr)
        before = target.store.stats.bytes_read
        events: list[TokenEvent] = []
        prefill = ProgressLine(unit=" tokens")
        stream = engine.stream(prompt, messages=messages, options=options, progress=prefill)
        async for event in stream:
            events.append(event)
            sys.stdout.write(event.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        read = target.store.stats.bytes_read - before
    steps = len({e.step for e in events})
    last = events[-1]
    return Summary(
        prompt_tokens=last.prompt_tokens,
        generated_tokens=last.generated_tokens,
        finish_reason=last.finish_reason,
        first_token_seconds=events[0].elapsed_seconds,
        prefill_tokens_per_second=prefill_rate(events[0]),
        decode_tokens_per_second=decode_rate(*decode_phase(events)),
        peak_rss_bytes=peak_rss_bytes(),
        seed=options.sampling.reported_seed,
        steps=steps,
        tokens_per_step=per_step(len(events), steps),
        from_draft=sum(e.from_draft for e in events),
        bytes_read_per_token=read // len(events),
        load_seconds=loaded,
        cached_tokens=last.cached_tokens,
    )
