"""Serving benchmarks of the cluster issue, on the embedded tiny model, CPU.

1. Overhead of the gateway + router + Ray hops: TTFT and ITL at concurrency 1
   through HTTP (local Ray, `pdserve serve` defaults: 1 prefill + 1 decode
   worker) vs the same requests on an in-process engine (AsyncEngine, no HTTP).
2. Throughput: 256-token prompts, 64 output tokens, concurrency 16, through
   HTTP: output tokens/s and median TPOT.

TTFT = first streamed token - request sent; ITL = gaps between streamed
chunks; TPOT = (E2E - TTFT) / (output tokens - 1). Medians.

    python bench/cluster_serving.py [--requests 32] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx
import torch
from machine import cpu_name


@dataclass
class Timing:
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: int = 0

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(self.tokens - 1, 1)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (length,), generator=g).tolist() for _ in range(n)]


async def http_one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> Timing:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t = Timing()
    start = last = time.perf_counter()
    chunks = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            payload = json.loads(line[5:])
            if not payload.get("choices"):  # the usage chunk: a chunk may carry several tokens
                t.tokens = payload["usage"]["completion_tokens"]
                continue
            now = time.perf_counter()
            if chunks == 0:
                t.ttft = now - start
            else:
                t.itl.append(now - last)
            last = now
            chunks += 1
    t.e2e = last - start
    return t


async def engine_one(engine: object, rid: str, prompt: list[int], max_tokens: int) -> Timing:
    from pdserve import SamplingParams

    t = Timing()
    start = last = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    async for out in engine.generate(rid, prompt, params, 600):  # type: ignore[attr-defined]
        now = time.perf_counter()
        if t.tokens == 0:
            t.ttft = now - start
        else:
            t.itl.append(now - last)
        last = now
        t.tokens += len(out.outputs[0].token_ids)
    t.e2e = last - start
    return t


async def run_load(one, items: list[list[int]], concurrency: int, max_tokens: int) -> tuple[list[Timing], float]:  # noqa: ANN001
    sem = asyncio.Semaphore(concurrency)

    async def guarded(i: int, p: list[int]) -> Timing:
        async with sem:
            return await one(i, p, max_tokens)

    start = time.perf_counter()
    timings = await asyncio.gather(*(guarded(i, p) for i, p in enumerate(items)))
    return list(timings), time.perf_counter() - start


def summary(timings: list[Timing], wall: float) -> dict[str, float]:
    itl = [x for t in timings for x in t.itl]
    return {"ttft_p50_ms": statistics.median(t.ttft for t in timings) * 1e3,
            "itl_p50_ms": statistics.median(itl) * 1e3 if itl else float("nan"),
            "tpot_p50_ms": statistics.median(t.tpot for t in timings) * 1e3,
            "output_tok_s": sum(t.tokens for t in timings) / wall}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def bench_engine(model_dir: str, overhead_prompts: list[list[int]]) -> dict[str, float]:
    """In-process engine (one worker, the same engine config as a served worker), concurrency 1."""
    from pdserve import LLM
    from pdserve.workers.async_engine import AsyncEngine

    torch.set_num_threads(1)
    engine = AsyncEngine(LLM(model_dir, progress=False).engine).start()

    async def in_process(i: int, p: list[int], mt: int) -> Timing:
        return await engine_one(engine, f"e{i}-{time.monotonic_ns()}", p, mt)

    print("[bench] in-process engine, concurrency 1 ...", file=sys.stderr, flush=True)
    asyncio.run(run_load(in_process, overhead_prompts[:4], 1, 8))  # warm-up
    result = summary(*asyncio.run(run_load(in_process, overhead_prompts, 1, 32)))
    engine.close()
    return result


def bench_http(model_dir: str, port: int, overhead_prompts: list[list[int]],
               load_prompts: list[list[int]]) -> dict[str, dict[str, float]]:
    """Through HTTP on a local Ray cluster (`pdserve serve` defaults): concurrency 1, then the throughput load."""
    from pdserve.cluster import serve_app
    from pdserve.cluster.leftovers import check_ports
    from pdserve.cluster.serve_config import serve_config

    results: dict[str, dict[str, float]] = {}
    cfg = serve_config({"model": model_dir, "port": port})
    # What `serve_app.run` does before it starts local Ray, which it skips once Ray is up (here):
    # an earlier run's orphaned HAProxy on these ports is stopped, anything else there is an error.
    check_ports(serve_app.bound_ports(cfg))
    serve_app.init_ray(cfg, log_to_driver=False)
    try:
        serve_app.run(cfg, block=False)
        url, model = f"http://127.0.0.1:{port}", os.path.basename(model_dir)

        async def over_http(items: list[list[int]], conc: int, mt: int) -> tuple[list[Timing], float]:
            async with httpx.AsyncClient(timeout=600) as client:
                return await run_load(lambda i, p, m: http_one(client, url, model, p, m), items, conc, mt)

        print("[bench] HTTP, concurrency 1 ...", file=sys.stderr, flush=True)
        asyncio.run(over_http(overhead_prompts[:4], 1, 8))  # warm-up
        results["http_c1"] = summary(*asyncio.run(over_http(overhead_prompts, 1, 32)))
        print("[bench] HTTP, 256 in / 64 out, concurrency 16 ...", file=sys.stderr, flush=True)
        results["http_c16"] = summary(*asyncio.run(over_http(load_prompts, 16, 64)))
    finally:
        serve_app.shutdown(cfg)
        serve_app.stop_ray(cfg)
    return results


def print_tables(results: dict[str, dict[str, float]]) -> None:
    e, h, h16 = results["engine_c1"], results["http_c1"], results["http_c16"]
    print("## Gateway + router overhead (concurrency 1, 128-token prompts, 32 output tokens)\n")
    print("| metric | in-process engine | HTTP, 1P+1D | added | bar |\n|---|---|---|---|---|")
    print(f"| p50 TTFT, ms | {e['ttft_p50_ms']:.1f} | {h['ttft_p50_ms']:.1f} "
          f"| {h['ttft_p50_ms'] - e['ttft_p50_ms']:.1f} | <= 15 ms added |")
    print(f"| p50 ITL, ms | {e['itl_p50_ms']:.2f} | {h['itl_p50_ms']:.2f} "
          f"| {h['itl_p50_ms'] - e['itl_p50_ms']:.2f} | <= 1 ms added |")
    print("\n## Throughput (256 in, 64 out, concurrency 16, 1P+1D over HTTP)\n")
    print("| metric | value | bar |\n|---|---|---|")
    print(f"| output tokens/s | {h16['output_tok_s']:.0f} | >= 2000 |")
    print(f"| p50 TPOT, ms | {h16['tpot_p50_ms']:.2f} | <= 8 |")
    print(f"| p50 TTFT, ms | {h16['ttft_p50_ms']:.1f} | - |")


def main() -> int:
    a = parse_args()
    from pdserve.workers.tiny.builder import default_model_dir

    model_dir = str(default_model_dir(progress=True))
    cpu = cpu_name()
    print(f"# pdserve cluster serving benchmark\ncommand: python {' '.join(sys.argv)}\n"
          f"machine: {cpu}, {os.cpu_count()} cores; torch {torch.__version__}\n", flush=True)
    overhead_prompts = prompts(a.requests, 128, seed=1)
    load_prompts = prompts(a.requests * 2, 256, seed=2)
    results = {"engine_c1": bench_engine(model_dir, overhead_prompts)}
    results.update(bench_http(model_dir, a.port, overhead_prompts, load_prompts))
    print_tables(results)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
