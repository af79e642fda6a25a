"""Random JSON schemas for structured-output checks and benchmarks: from a seed, object
schemas whose every instance is finite (strings, integers and arrays bounded; properties
required; no free whitespace in the output), so that a model under the schema's grammar
always ends well within a few hundred tokens, whatever its logits."""

from __future__ import annotations

import random
from typing import Any

ENUM_WORDS = ["red", "green", "blue", "a b", 'x"y', "é"]


def object_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """One schema: 1-4 properties of string, integer, boolean, enum, array, null and (two
    levels at most) nested object kinds."""
    props: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(["string", "integer", "boolean", "enum", "array", "null"] + (["object"] if depth < 2 else []))
        if kind == "string":
            p: dict[str, Any] = {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
        elif kind == "integer":
            low = rng.randint(-1000, 1000)
            p = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
        elif kind == "enum":
            p = {"enum": rng.sample(ENUM_WORDS, rng.randint(1, 4))}
        elif kind == "array":
            p = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                 "minItems": 0, "maxItems": rng.randint(1, 3)}
        elif kind == "object":
            p = object_schema(rng, depth + 1)
        else:
            p = {"type": kind}
        props[f"k{i}_{kind}"] = p
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def schemas(seed: int, n: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [object_schema(rng) for _ in range(n)]
