"""Prefix-cache hit rate with one gateway replica and with two (issue 47's bar: two replicas'
rate >= 0.95x of one's).

Each run starts `pdserve serve` (disaggregated, 2 prefill workers + 1 decode worker, the
cache-aware router, each prefill worker's pool holding about half of the prefixes), sends
a shared-prefix workload over HTTP (groups of requests sharing a long prefix, shuffled),
and reads what the workers' prefix caches served from /metrics (pdserve:prefix_cache_hits
and _queries summed over the workers, before and after the load). With two replicas
HAProxy spreads the connections over both, so requests of one prefix reach both routers,
each of which must know where every prefix went (shared routing state, docs/cluster.md).
Runs alternate between replica counts; the table has every run and the medians.

    python bench/replica_routing.py                      # 1 and 2 replicas, 2 runs each
    python bench/replica_routing.py --repeats 3 --concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from machine import cpu_name
from served import PDSERVE, start, stop, wait_healthy

REPLICA_HEADER = "x-pdserve-replica"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--replicas", default="1,2", help="replica counts to compare, alternating")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--groups", type=int, default=8, help="distinct shared prefixes")
    p.add_argument("--per-group", type=int, default=16, help="requests per prefix")
    p.add_argument("--prefix", type=int, default=512, help="tokens of each shared prefix")
    p.add_argument("--suffix", type=int, default=32, help="tokens of each request's own tail")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-kv-blocks", type=int, default=192, help="per worker: about half the prefixes fit")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def shared_prefix_prompts(a: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(a.seed)
    prefixes = [[rng.randrange(5, 4000) for _ in range(a.prefix)] for _ in range(a.groups)]
    prompts = [pre + [rng.randrange(5, 4000) for _ in range(a.suffix)] for pre in prefixes for _ in range(a.per_group)]
    rng.shuffle(prompts)
    return prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cache_counters(url: str) -> tuple[float, float]:
    """(prompt tokens looked up, prompt tokens served from the cache), summed over the workers."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text
    queries = hits = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("pdserve:prefix_cache_queries") and not s.name.endswith("_created"):
                queries += s.value
            elif s.name.startswith("pdserve:prefix_cache_hits") and not s.name.endswith("_created"):
                hits += s.value
    return queries, hits


async def drive(url: str, model: str, prompts: list[list[int]], concurrency: int) -> collections.Counter[str]:
    """Every prompt once (`concurrency` at a time, a connection each); which replica answered each."""
    served: collections.Counter[str] = collections.Counter()
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(p: list[int]) -> None:
        nonlocal done
        async with sem, httpx.AsyncClient(timeout=300, trust_env=False) as c:  # a connection each: HAProxy spreads them
            r = await c.post(f"{url}/v1/completions", json={"model": model, "prompt": p, "max_tokens": 2,
                                                              "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            served[r.headers.get(REPLICA_HEADER, "?")] += 1
            done += 1
            if done % 32 == 0:
                print(f"    {done}/{len(prompts)} requests", flush=True)

    await asyncio.gather(*(one(p) for p in prompts))
    return served


def one_run(a: argparse.Namespace, replicas: int, prompts: list[list[int]], logs: Path, i: int) -> dict[str, Any]:
    port = free_port()
    cmd = [PDSERVE, "serve", "--model", a.model, "--prefill", "2", "--decode", "1", "--router-policy", "cache_aware",
           "--gateway-replicas", str(replicas), "--num-kv-blocks", str(a.num_kv_blocks), "--max-model-len", "1024",
           "--max-num-batched-tokens", "1024", "--port", str(port), "--haproxy-metrics-port", str(free_port()),
           "--haproxy-stats-port", str(free_port()), "--haproxy-fallback-port", str(free_port())]
    log = logs / f"serve_{i}_r{replicas}.log"
    url = f"http://127.0.0.1:{port}"
    print(f"[{time.strftime('%H:%M:%S')}] run {i}: {replicas} replica(s): starting pdserve serve ...", flush=True)
    proc = start(cmd, log)
    try:
        wait_healthy(url, proc, log)
        q0, h0 = cache_counters(url)
        t0 = time.monotonic()
        served = asyncio.run(drive(url, a.model, prompts, a.concurrency))
        wall = time.monotonic() - t0
        q1, h1 = cache_counters(url)
    finally:
        stop(proc)
    queries, hits = q1 - q0, h1 - h0
    run = {"replicas": replicas, "served": dict(served), "queries": queries, "hits": hits,
           "hit_rate": hits / queries if queries else 0.0, "wall_s": wall}
    print(f"    hit rate {run['hit_rate']:.3f} ({hits:.0f} of {queries:.0f} prompt tokens), "
          f"by replica {dict(served)}, {wall:.1f} s", flush=True)
    return run


def print_table(a: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    print(f"\n# prefix-cache hit rate by gateway replicas\ncommand: python bench/replica_routing.py "
          f"{' '.join(sys.argv[1:])}\nmachine: {cpu_name()}\nworkload: {a.groups} prefixes x {a.per_group} requests, "
          f"prefix {a.prefix} + suffix {a.suffix} tokens, concurrency {a.concurrency}, 2P+1D, "
          f"{a.num_kv_blocks} KV blocks a worker\n")
    print("| run | replicas | requests by replica | prompt tokens looked up | from the cache | hit rate |")
    print("|---:|---:|---|---:|---:|---:|")
    for i, r in enumerate(runs):
        by = ", ".join(f"{n}" for _, n in sorted(r["served"].items()))
        print(f"| {i} | {r['replicas']} | {by} | {r['queries']:.0f} | {r['hits']:.0f} | {r['hit_rate']:.3f} |")
    medians = {n: statistics.median(r["hit_rate"] for r in runs if r["replicas"] == n)
               for n in sorted({r["replicas"] for r in runs})}
    print("\n| replicas | median hit rate | vs 1 replica |\n|---:|---:|---:|")
    base = medians.get(1)
    for n, m in medians.items():
        print(f"| {n} | {m:.3f} | {m / base:.3f}x |" if base else f"| {n} | {m:.3f} | - |")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    counts = [int(x) for x in a.replicas.split(",")]
    prompts = shared_prefix_prompts(a)
    runs = []
    with tempfile.TemporaryDirectory(prefix="pdserve-replica-routing-") as tmp:
        for rep in range(a.repeats):
            for n in counts if rep % 2 == 0 else counts[::-1]:
                runs.append(one_run(a, n, prompts, Path(tmp), len(runs)))
    print_table(a, runs)
    bad = [r for r in runs if r["replicas"] > 1 and len(r["served"]) < r["replicas"]]
    if bad:
        print(f"\nwarning: {len(bad)} run(s) with fewer replicas answering than started", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
