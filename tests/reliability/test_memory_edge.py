"""At the memory limit's edge (#62): under the smallest cgroup limit the engine agrees to
start with, 1,000 tokens decode to the end, never killed, equal to the text without a limit.
The edge is found by bisection, each try its own process under its own limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from lever_actors.bench.isolation import MemoryCgroup, probe_cgroup
from lever_actors.testing import TINY_ARGS, model_pair

SUPPORT = probe_cgroup()
pytestmark = pytest.mark.skipif(
    not SUPPORT.usable, reason=f"no memory limits to test under: {SUPPORT.reason}"
)

MIB = 2**20
TOKENS = 1000
STEP = 8 * MIB  # the bisection's resolution
LAUNCH = "from lever_actors.launch import console; console()"


def generate(target: Path, tokens: int, limit: int | None) -> subprocess.CompletedProcess[str]:
    """`generate` of `tokens` greedy tokens in a child process, under `limit` bytes where
    given (the child joins the cgroup before it runs anything)."""
    flags = ["--target", str(target), "--plan", "ar", "--prompt", "t1 t2 t3"]
    command = [sys.executable, "-c", LAUNCH, "generate", *flags]
    command += ["--max-new-tokens", str(tokens), "--stats", "json"]
    if limit is None:
        return subprocess.run(command, capture_output=True, text=True, timeout=300)
    cgroup = MemoryCgroup(SUPPORT, f"lever-edge-{os.getpid()}-{limit}", limit)
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=lambda: cgroup.add(os.getpid()),
        )
        assert cgroup.oom_kills() == 0, f"killed under {limit // MIB} MiB: {done.stderr}"
        return done
    finally:
        cgroup.remove()


def smallest_accepted_limit(target: Path) -> int:
    """The least limit, to STEP, under which the engine starts (one token decoded); below it
    the start is refused in one line."""
    refused, accepted = 64 * MIB, 1024 * MIB
    assert generate(target, 1, accepted).returncode == 0
    while accepted - refused > STEP:
        middle = (refused + accepted) // 2
        try_it = generate(target, 1, middle)
        if try_it.returncode == 0:
            accepted = middle
        else:
            assert try_it.returncode == 2 and "raise the limit" in try_it.stderr, try_it.stderr
            refused = middle
    return accepted


def test_a_thousand_tokens_at_the_limits_edge_run_to_the_end_exact():
    args = msgspec.structs.replace(TINY_ARGS, max_seq_len=TOKENS + 64)
    target = model_pair(args, "perturbed", 0, tokenizer="words").target
    edge = smallest_accepted_limit(target)
    at_edge = generate(target, TOKENS, edge)
    free = generate(target, TOKENS, None)
    assert at_edge.returncode == 0, at_edge.stderr
    stats = json.loads(at_edge.stderr.strip().splitlines()[-1])
    assert (stats["generated_tokens"], stats["finish_reason"]) == (TOKENS, "length")
    assert at_edge.stdout == free.stdout  # the same text as without a limit
