"""Several long prompts at once under a memory limit (#64, E1): alone and three at once, a
server in a child process under a cgroup limit answers three long prompts sent together,
never killed, each answer the same text whatever the parallel. The model is KV-heavy (a
token's KV is 320 KiB, target and draft), so the requests' KV and the prefix cache take
most of the limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import pytest

from lever_actors.bench.isolation import MemoryCgroup, probe_cgroup
from lever_actors.testing import TINY_ARGS, model_pair

SUPPORT = probe_cgroup()
pytestmark = pytest.mark.skipif(
    not SUPPORT.usable, reason=f"no memory limits to test under: {SUPPORT.reason}"
)

LIMIT = 1100 * 2**20
PROMPTS = [" ".join(f"t{(i * step) % 30 + 1}" for i in range(600)) for step in (1, 7, 11)]
# the child: a server on a free port and three clients at once; prints each answer's text
CHILD = """
import json, sys, httpx, trio
from functools import partial
from lever_actors.config import EngineConfig
from lever_actors.serve import serve
from lever_actors.serve.options import ServeOptions
target, draft, parallel, prompts = json.loads(sys.argv[1])
config = EngineConfig(target=target, draft=draft, tree="chain:2", parallel=parallel)
texts = [None] * len(prompts)
async def ask(http, i):
    body = {"prompt": prompts[i], "max_tokens": 16, "temperature": 0}
    response = await http.post("/v1/completions", json=body, timeout=120)
    texts[i] = [response.status_code, response.json()["choices"][0]["text"]]
async def main():
    async with trio.open_nursery() as nursery:
        base = (await nursery.start(partial(serve, config, ServeOptions(port=0))))[0]
        async with httpx.AsyncClient(base_url=base) as http, trio.open_nursery() as clients:
            for i in range(len(prompts)):
                clients.start_soon(ask, http, i)
        nursery.cancel_scope.cancel()
trio.run(main)
print(json.dumps(texts))
"""


@pytest.fixture(scope="module")
def kv_heavy():
    args = msgspec.structs.replace(
        TINY_ARGS, n_layers=16, n_heads=8, n_kv_heads=8, head_dim=128, max_seq_len=4096
    )
    return model_pair(args, "perturbed", 0, tokenizer="words")


def answers_under_the_limit(kv_heavy, parallel: int) -> list[list]:
    cgroup = MemoryCgroup(SUPPORT, f"lever-batch-{os.getpid()}-{parallel}", LIMIT)
    given = json.dumps([str(kv_heavy.target), str(kv_heavy.draft), parallel, PROMPTS])
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, given],
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=lambda: cgroup.add(os.getpid()),
        )
        assert cgroup.oom_kills() == 0, f"killed with parallel {parallel}: {done.stderr[-2000:]}"
    finally:
        cgroup.remove()
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_long_prompts_at_once_under_a_limit_are_never_killed_and_answer_alike(kv_heavy):
    alone = answers_under_the_limit(kv_heavy, 1)
    assert [status for status, _ in alone] == [200] * len(PROMPTS)
    # three at once hold the most KV beside the prefix cache; two sat between (CI's time)
    assert answers_under_the_limit(kv_heavy, 3) == alone
