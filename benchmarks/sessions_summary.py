"""Issue 47's sessions summary, benchmarks/results/conversation.json, from the runs under 1.0 GiB
and 3 GiB: benchmarks/conversation.py's (conversation-1GiB.json, conversation-3GiB.json) and
benchmarks/long_prompt.py's 2,000-token prompt's (long_prompt-2k-1GiB.json,
long_prompt-2k-3GiB.json). It computes nothing: it picks from the runs' own summaries (the
1 GiB conversations' warm-over-cold TTFT, llama-server ratio and start-up; each limit's
prefill ratio at --budget) and takes the least agreement of the two limits'.

    .venv/bin/python benchmarks/sessions_summary.py [--tokens 2000] [--budget auto] [--note TEXT]

after, for LIMIT in 1GiB and 3GiB:

    .venv/bin/python benchmarks/conversation.py --llama-server --dram-budget auto \
        --memory-limit LIMIT
    .venv/bin/python benchmarks/long_prompt.py --tokens 2000 --repeats 2 --budgets auto \
        --memory-limit LIMIT --out benchmarks/results/long_prompt-2k-LIMIT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
LIMITS = {"1GiB": 2**30, "3GiB": 3 * 2**30}
OUT = "conversation.json"


def conversation_file(limit: str) -> str:
    return f"conversation-{limit}.json"


def long_prompt_file(limit: str) -> str:
    return f"long_prompt-2k-{limit}.json"


def load(name: str, limit: str) -> dict:
    """The results file `name`, which must be a run under `limit` with a summary."""
    path = RESULTS / name
    if not path.exists():
        raise SystemExit(f"{path}: missing; run the bench under {limit} first")
    record = json.loads(path.read_text())
    if record.get("memory_limit_bytes") != LIMITS[limit] or "summary" not in record:
        raise SystemExit(f"{path}: not a run under {limit} with a summary")
    return record


def pick(record: dict, name: str, *keys: str) -> Any:
    """The value at `keys` in the summary of `record`, read from `name`."""
    value = record["summary"]
    for key in keys:
        if key not in value:
            raise SystemExit(f"{RESULTS / name}: its summary has no {'/'.join(keys)}")
        value = value[key]
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2000", help="the long prompt's size, as asked for")
    parser.add_argument("--budget", default="auto", help="Lever's budget in the long prompt runs")
    parser.add_argument("--note", help="kept in the record, e.g. why a peer's session is missing")
    args = parser.parse_args()
    chats = {limit: load(conversation_file(limit), limit) for limit in LIMITS}
    longs = {limit: load(long_prompt_file(limit), limit) for limit in LIMITS}
    if len({json.dumps(record["conversations"]) for record in chats.values()}) != 1:
        raise SystemExit("the limits' conversation runs sent different conversations")

    chat_1g = conversation_file("1GiB")

    def prefill(limit: str) -> float:
        name = long_prompt_file(limit)
        return pick(longs[limit], name, "prefill_vs_llamacpp", args.tokens, args.budget)

    summary = {
        "warm_ttft_over_cold": pick(chats["1GiB"], chat_1g, "warm_ttft_over_cold"),
        "prefill_vs_llamacpp_1GiB": prefill("1GiB"),
        "prefill_vs_llamacpp_3GiB": prefill("3GiB"),
        # None where the 1 GiB run had no llama-server session (--note says why)
        "turn_ttft_vs_llamacpp_server_1GiB": chats["1GiB"]["summary"].get(
            "turn_ttft_vs_llamacpp_server"
        ),
        "startup_seconds": pick(chats["1GiB"], chat_1g, "startup_seconds"),
        "min_agreement": min(
            pick(chats[limit], conversation_file(limit), "min_agreement") for limit in LIMITS
        ),
    }
    sources = {
        "warm_ttft_over_cold": [chat_1g],
        "prefill_vs_llamacpp_1GiB": [long_prompt_file("1GiB")],
        "prefill_vs_llamacpp_3GiB": [long_prompt_file("3GiB")],
        "turn_ttft_vs_llamacpp_server_1GiB": [chat_1g],
        "startup_seconds": [chat_1g],
        "min_agreement": [conversation_file(limit) for limit in LIMITS],
    }
    record = {
        "machine": chats["1GiB"]["machine"],
        "summary": summary,
        "sources": sources,
        "note": args.note,
        "long_prompt": {"tokens": int(args.tokens), "lever_budget": args.budget},
        "conversations": [
            {"item": c["item"], "id": c["id"], "turns": len(c["turns"])}
            for c in chats["1GiB"]["conversations"]
        ],
        "by_limit": {
            limit: {
                "dram_budget": chats[limit]["dram_budget"],
                "conversation": chats[limit]["summary"],
                "long_prompt": longs[limit]["summary"],
            }
            for limit in LIMITS
        },
    }
    (RESULTS / OUT).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
