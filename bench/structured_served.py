"""Structured outputs and tool calls through a served `pdserve serve` with the openai client
(issue 48's validity and tool bars), on any model: SmolLM2, as a user would run it.

- validity: `--schemas` random object schemas (pdserve.cluster.bench.schemas, seed 48) as
  `response_format` json_schema, greedy and sampled: how many answers finish, parse as JSON
  and validate with `jsonschema`;
- tools: `--calls` requests with `tool_choice="required"` and as many with a named function,
  sampled: how many return `tool_calls` whose names are tools and whose arguments validate.

Requests go `--concurrency` at a time. Flags after `--` go to `pdserve serve`.

    python bench/structured_served.py [--model DIR] [--schemas 200] [--calls 100] [-- --mode colocated]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from machine import cpu_name  # bench/ is on sys.path when run as a script
from served import PDSERVE, start, stop, wait_healthy

from pdserve.cluster.bench.schemas import schemas

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model directory (default: pdserve serve's default model)")
    p.add_argument("--schemas", type=int, default=200, help="0: none")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("serve_args", nargs="*", help="after --: flags for pdserve serve")
    return p.parse_args()


def valid_json(text: str | None, schema: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def count(n: int, concurrency: int, one: Callable[[int], bool]) -> tuple[int, list[int]]:
    with ThreadPoolExecutor(concurrency) as pool:
        ok = list(pool.map(one, range(n)))
    return sum(ok), [i for i, good in enumerate(ok) if not good][:5]


def main() -> int:
    import openai

    a = parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="structured-served-"))
    cmd = [PDSERVE, "serve", "--port", str(a.port), *(["--model", a.model] if a.model else []), *a.serve_args]
    print(f"[structured-served] {' '.join(cmd[1:])} ...", file=sys.stderr, flush=True)
    server = start(cmd, tmp / "serve.log")
    rows: list[tuple[str, int, int, list[int]]] = []
    try:
        url = f"http://127.0.0.1:{a.port}"
        wait_healthy(url, server, tmp / "serve.log")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        cases = schemas(48, a.schemas)

        def schema_answer(temperature: float) -> Callable[[int], bool]:
            def one(i: int) -> bool:
                r = client.chat.completions.create(
                    model=model, max_tokens=a.max_tokens, temperature=temperature, seed=i,
                    messages=[{"role": "user", "content": f"Fill in record {i} as JSON."}],
                    response_format={"type": "json_schema", "json_schema": {"name": f"r{i}", "schema": cases[i]}})
                return r.choices[0].finish_reason == "stop" and valid_json(r.choices[0].message.content, cases[i])
            return one

        for name, temperature in (("json_schema, greedy", 0.0), ("json_schema, sampled (t=1)", 1.0)):
            if not a.schemas:
                break
            print(f"[structured-served] {name} ...", file=sys.stderr, flush=True)
            rows.append((name, a.schemas, *count(a.schemas, a.concurrency, schema_answer(temperature))))

        def call(choice: Any, names: set[str]) -> Callable[[int], bool]:
            def one(i: int) -> bool:
                r = client.chat.completions.create(
                    model=model, max_tokens=a.max_tokens, temperature=0.7, seed=i, tools=TOOLS, tool_choice=choice,
                    messages=[{"role": "user", "content": ["Weather in Paris?", "What time is it in Tokyo?"][i % 2]}])
                calls = r.choices[0].message.tool_calls or []
                ok = bool(calls) and all(c.function.name in names
                                         and valid_json(c.function.arguments, SCHEMAS[c.function.name])
                                         for c in calls)
                if not ok:  # what came back instead, for the record
                    print(f"[structured-served] {i}: {r.choices[0].finish_reason}: "
                          f"{(r.choices[0].message.content or '')[:300]!r} {calls}", file=sys.stderr, flush=True)
                return ok
            return one

        named = {"type": "function", "function": {"name": "get_weather"}}
        for name, choice, names in (('tool_choice "required"', "required", set(SCHEMAS)),
                                    ("tool_choice get_weather", named, {"get_weather"})):
            print(f"[structured-served] {name} ...", file=sys.stderr, flush=True)
            rows.append((name, a.calls, *count(a.calls, a.concurrency, call(choice, names))))
    finally:
        stop(server)
    print(f"# python bench/structured_served.py {' '.join(sys.argv[1:])}; {cpu_name()}")
    print(f"model {a.model or '(pdserve serve default)'}, max_tokens {a.max_tokens}, concurrency {a.concurrency}\n")
    print("| what | requests | valid | first failures (index) |")
    print("|---|---:|---:|---|")
    for name, n, ok, failed in rows:
        print(f"| {name} | {n} | {ok} | {', '.join(map(str, failed)) or '-'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
