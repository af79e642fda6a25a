"""Generated hostile requests against a running `pdserve serve` (issue 46's first bar):
hypothesis draws N requests over the OpenAI completions, chat and Responses schemas, with the
extremes of every numeric field (tests/hostile.py), and they are sent at a small
concurrency. The bar: 0 worker restarts, 0 5xx, every refusal a 400 naming a field
the request sent, every answer whole.

    pdserve serve --model tiny --max-model-len 256 &
    python bench/hostile_requests.py --url http://127.0.0.1:8000 -n 10000

Prints the outcomes, the failures by kind (with an example of each), and the server's
own counters before and after (workers lost and restarted, requests failed alone).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from machine import cpu_name

# The generator is test tooling (tests/hostile.py), as the chaos harness is: tests/ first on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hostile import Verdict, encode, judge, requests  # noqa: E402

COUNTERS = ("pdserve:workers_lost_total", "pdserve:workers_restarted_total", "pdserve:requests_faulted_total")


def draw(n: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """n requests from the strategy, drawn once (no shrinking: every example is kept)."""
    out: list[tuple[str, dict[str, Any]]] = []

    @hypothesis_seed(seed)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(requests())
    def collect(request: tuple[str, dict[str, Any]]) -> None:
        out.append(request)

    collect()
    return out


def counters(client: httpx.Client, url: str) -> dict[str, float]:
    text = client.get(f"{url}/metrics", timeout=30).text
    found = {}
    for name in COUNTERS:
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        found[name] = float(m.group(1)) if m else float("nan")
    return found


async def send(url: str, reqs: list[tuple[str, dict[str, Any]]], concurrency: int,
               timeout_s: float) -> list[tuple[dict[str, Any], Verdict]]:
    results: list[tuple[dict[str, Any], Verdict]] = []
    queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    done = 0
    start = time.monotonic()

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        while not queue.empty():
            route, body = queue.get_nowait()
            try:
                r = await client.post(f"{url}{route}", content=encode(body),
                                      headers={"content-type": "application/json"}, timeout=timeout_s)
                verdict = judge(body, r.status_code, r.text)
            except httpx.HTTPError as e:
                verdict = Verdict(False, f"transport: {type(e).__name__}", str(e)[:200])
            results.append((body, verdict))
            done += 1
            if done % 500 == 0:
                print(f"  {done}/{len(reqs)} sent, {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("-n", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=46)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    args = ap.parse_args()

    print(f"# bench/hostile_requests.py -n {args.n} --concurrency {args.concurrency} --seed {args.seed}; "
          f"{cpu_name()}", flush=True)
    t0 = time.monotonic()
    reqs = draw(args.n, args.seed)
    print(f"drew {len(reqs)} requests in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    with httpx.Client() as c:
        before = counters(c, args.url)
        t1 = time.monotonic()
        results = asyncio.run(send(args.url, reqs, args.concurrency, args.timeout))
        took = time.monotonic() - t1
        after = counters(c, args.url)
        health = c.get(f"{args.url}/health", timeout=30).status_code

    kinds = Counter(v.kind for _, v in results if v.ok)
    failures = Counter(v.kind for _, v in results if not v.ok)
    fields = Counter(v.detail for _, v in results if v.ok and v.kind == "refused")
    print(f"\n{'requests':>10} {'answered':>9} {'refused':>8} {'failed':>7} {'5xx':>5} {'seconds':>8}")
    fivexx = sum(n for k, n in failures.items() if k.startswith("HTTP 5"))
    print(f"{len(results):>10} {kinds['answered']:>9} {kinds['refused']:>8} {sum(failures.values()):>7} "
          f"{fivexx:>5} {took:>8.0f}")
    print("\nrefusals by the field named: " + ", ".join(f"{f} {n}" for f, n in fields.most_common()))
    for kind, n in failures.most_common():
        example = next((b, v.detail) for b, v in results if not v.ok and v.kind == kind)
        print(f"FAILED {n} x {kind}: e.g. {example}")
    print("\nserver counters (before -> after): " + "; ".join(
        f"{k.removeprefix('pdserve:')} {before[k]:g} -> {after[k]:g}" for k in COUNTERS))
    print(f"/health after: {health}")
    restarted = after["pdserve:workers_restarted_total"] - before["pdserve:workers_restarted_total"]
    ok = not failures and restarted == 0 and health == 200
    print("bar (0 restarts, 0 5xx, every refusal a 400 naming a field):", "met" if ok else "NOT met")


if __name__ == "__main__":
    main()
