"""Structured output on the real pair: ten prompts that each ask for JSON of a schema, each
decoded greedily with its schema as the grammar and without it, alternating, in one engine.
Reports decode tok/s with the schema over without (what the masks cost; the target is at
least 0.9), tokens per step both ways, and the share of outputs that parse and validate
under their schema (the target is all of those with the schema).

    .venv/bin/python benchmarks/structured.py [--new-tokens 128] [--dram-budget 25%]
                                         [--out benchmarks/results/structured.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean

import jsonschema
import msgspec
import trio

from lever_actors.bench.results import Machine
from lever_actors.checkpoints.real_pair import real_model_path, real_target_layout
from lever_actors.config import EngineConfig
from lever_actors.engine import Engine
from lever_actors.engine.results import GenerationResult
from lever_actors.model.grammar import Grammar
from lever_actors.paths import default_cache_dir


def strings(*names: str) -> dict:
    return {name: {"type": "string"} for name in names}


def record(properties: dict) -> dict:
    """An object with exactly `properties`, all required."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def listed(item: dict, most: int = 5) -> dict:
    return {"type": "array", "items": item, "maxItems": most}


# (the request, the schema of its answer), written for this benchmark
PROMPTS = [
    (
        "Describe a fictional software engineer as JSON.",
        record(
            {
                **strings("name", "city"),
                "years": {"type": "integer"},
                "skills": listed({"type": "string"}),
            }
        ),
    ),
    (
        "Give the metadata of a classic novel as JSON.",
        record(
            {
                **strings("title", "author"),
                "year": {"type": "integer"},
                "genres": listed({"type": "string"}, 3),
            }
        ),
    ),
    (
        "Write a simple pancake recipe as JSON.",
        record(
            {
                "name": {"type": "string"},
                "servings": {"type": "integer"},
                "ingredients": listed(record(strings("item", "amount")), 6),
                "steps": listed({"type": "string"}, 6),
            }
        ),
    ),
    (
        "Report the weather of a made-up city for tomorrow as JSON.",
        record(
            {
                "city": {"type": "string"},
                "high_c": {"type": "number"},
                "low_c": {"type": "number"},
                "sky": {"enum": ["clear", "cloudy", "rain", "snow"]},
            }
        ),
    ),
    (
        "Describe the signature of a Python function that merges two sorted lists, as JSON.",
        record(
            {
                "name": {"type": "string"},
                "parameters": listed(record(strings("name", "type")), 4),
                "returns": {"type": "string"},
            }
        ),
    ),
    (
        "Make a to-do list for moving house, as JSON.",
        record(
            {
                "title": {"type": "string"},
                "tasks": listed(
                    record({"task": {"type": "string"}, "done": {"type": "boolean"}}), 6
                ),
            }
        ),
    ),
    (
        "Describe a laptop for sale as a JSON product listing.",
        record(
            {
                **strings("brand", "model"),
                "price_usd": {"type": "number"},
                "in_stock": {"type": "boolean"},
                "features": listed({"type": "string"}, 4),
            }
        ),
    ),
    (
        "Write an HTTP request that creates a user through a REST API, as JSON.",
        record(
            {
                "method": {"enum": ["GET", "POST", "PUT", "DELETE"]},
                "path": {"type": "string"},
                "headers": listed(record(strings("name", "value")), 3),
                "body": record(strings("username", "email")),
            }
        ),
    ),
    (
        "Describe a unit test for a function that reverses a string, as JSON.",
        record(
            {
                **strings("test_name", "function"),
                "input": {"type": "string"},
                "expected": {"type": "string"},
            }
        ),
    ),
    (
        "Give the postal address of a fictional company in Berlin as JSON.",
        record(
            {
                **strings("company", "street", "city", "country"),
                "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
            }
        ),
    ),
]


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def figures(result: GenerationResult, schema: dict) -> dict:
    return {
        "tokens": result.generated_tokens,
        "finish": result.finish_reason,
        "decode_tok_s": result.decode_tokens_per_second,
        "tokens_per_step": result.mean_accepted,
        "valid": valid(result.text, schema),
        "text": result.text,
    }


async def measure(config: EngineConfig, new_tokens: int) -> list[dict]:
    rows = []
    async with Engine.open(config) as engine:
        await engine.generate("Hello", max_new_tokens=4)  # warm: first-request costs aside
        for prompt, schema in PROMPTS:
            messages = [{"role": "user", "content": prompt}]
            free = await engine.generate(messages=messages, max_new_tokens=new_tokens)
            held = await engine.generate(
                messages=messages, max_new_tokens=new_tokens, grammar=Grammar.json_schema(schema)
            )
            row = {"prompt": prompt, "free": figures(free, schema), "schema": figures(held, schema)}
            print(
                f"{prompt[:40]:40}  free {row['free']['decode_tok_s']:.2f} tok/s "
                f"{row['free']['tokens_per_step']:.2f}/step valid {row['free']['valid']}  "
                f"schema {row['schema']['decode_tok_s']:.2f} tok/s "
                f"{row['schema']['tokens_per_step']:.2f}/step valid {row['schema']['valid']}",
                flush=True,
            )
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dram-budget", default="25%")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/structured.json"))
    args = parser.parse_args()
    cache = default_cache_dir()
    config = EngineConfig(
        target=str(real_target_layout(cache)),
        draft=str(real_model_path(cache, "draft")),
        dram_budget=args.dram_budget,
    )
    rows = trio.run(measure, config, args.new_tokens)
    ratios = [r["schema"]["decode_tok_s"] / r["free"]["decode_tok_s"] for r in rows]
    summary = {
        "schema_over_free_decode": mean(ratios),
        "schema_over_free_decode_each": ratios,
        "tokens_per_step_free": mean(r["free"]["tokens_per_step"] for r in rows),
        "tokens_per_step_schema": mean(r["schema"]["tokens_per_step"] for r in rows),
        "valid_share_schema": mean(r["schema"]["valid"] for r in rows),
        "valid_share_free": mean(r["free"]["valid"] for r in rows),
    }
    print(json.dumps(summary, indent=2))
    out = {
        "machine": msgspec.to_builtins(Machine.here()),
        "command": "benchmarks/structured.py "
        + " ".join([f"--new-tokens {args.new_tokens}", f"--dram-budget {args.dram_budget}"]),
        "summary": summary,
        "prompts": rows,
    }
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
