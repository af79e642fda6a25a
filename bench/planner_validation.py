"""The planner's predictions against the real cluster (issue 18, item 4).

For each configuration, starts `pdserve serve`, warms it up, and runs `pdserve bench`
at each rate (Poisson arrivals, exact lengths, EOS ignored); then simulates the very
same requests (the bench's own workload builder, same flags and seed) through the
profile, and prints predicted vs measured TTFT and TPOT p50/p90 with the error of
each prediction. One server per configuration, started with the profile's dtype, killed
(its process group) whatever happens.

    python bench/planner_validation.py --profile bench/results/profile_tiny_....json \\
        --model tiny --configs 1P+1D,2 --rates 4,8,12 [--num-requests 150] [--out results.json]

A configuration is `PxD`-style `1P+1D` (disaggregated) or `N` (N colocated workers).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from served import PDSERVE, profile_dtype, start, stop, wait_healthy


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True)
    p.add_argument("--model", default="tiny")
    p.add_argument("--configs", default="1P+1D,2")
    p.add_argument("--rates", default="4,8,12")
    p.add_argument("--num-requests", type=int, default=150)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dispatch-ms", type=float, default=0.0,
                   help="the gateway's per-request cost the simulator adds to every TTFT")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `pdserve serve` argument (repeat)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    return p.parse_args()


def serve_args(config: str) -> list[str]:
    from pdserve.cluster.planner.planner import parse_shape

    shape = parse_shape(config)
    if shape.is_colocated:
        return ["--mode", "colocated", "--workers", str(shape.num_colocated)]
    return ["--mode", "disaggregated", "--prefill", str(shape.num_prefill), "--decode", str(shape.num_decode)]


def bench(a: argparse.Namespace, url: str, rate: float, n: int, seed: int, out: Path) -> dict[str, Any]:
    cmd = [PDSERVE, "bench", "--base-url", f"{url}/v1", "--input-len", str(a.input_len), "--output-len",
           str(a.output_len), "--range-ratio", "0", "--num-requests", str(n), "--request-rate", str(rate),
           "--ignore-eos", "--seed", str(seed), "--result-json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(f"pdserve bench failed ({done.returncode}):\n{done.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads(out.read_text())["runs"][0]["summary"]
    return summary


def measure(a: argparse.Namespace, config: str, rates: list[float], tmp: Path) -> dict[float, dict[str, Any]]:
    url = f"http://127.0.0.1:{a.port}"
    log = tmp / f"serve-{config}.log"
    server = start([PDSERVE, "serve", "--model", a.model, *serve_args(config), "--dtype", profile_dtype(a.profile),
                    "--port", str(a.port), *a.serve_arg], log)
    try:
        print(f"[validate] {config}: starting the server ...", file=sys.stderr, flush=True)
        wait_healthy(url, server, log, 600)
        bench(a, url, rates[0], 20, a.seed + 1000, tmp / "warm.json")  # compile, caches: not measured
        out: dict[float, dict[str, Any]] = {}
        for i, rate in enumerate(rates):
            print(f"[validate] {config}: {a.num_requests} requests at {rate} req/s ...", file=sys.stderr, flush=True)
            # A seed per rate: the same prompts again would hit the prefix cache the last rate left.
            out[rate] = bench(a, url, rate, a.num_requests, a.seed + i, tmp / f"{config}-{rate}.json")
        return out
    finally:
        stop(server)


def predict(a: argparse.Namespace, config: str, rate: float, seed: int) -> dict[str, Any]:
    from pdserve.cluster.bench.config import BenchConfig
    from pdserve.cluster.planner.planner import parse_shape
    from pdserve.cluster.planner.profile import Profile
    from pdserve.cluster.planner.sim_metrics import summary
    from pdserve.cluster.planner.sim_workload import Workload
    from pdserve.cluster.planner.simulator import engine_settings, simulate

    profile = Profile.load(a.profile)
    engine = engine_settings(profile)
    cfg = BenchConfig("http://sim/v1", input_len=a.input_len, output_len=a.output_len, num_requests=a.num_requests,
                      seed=seed, range_ratio=0.0, ignore_eos=True)
    requests = Workload.build(cfg, engine.block_size).at_rate(rate)
    shape = dataclasses.replace(parse_shape(config), dispatch_s=a.dispatch_ms / 1000)
    return summary(simulate(profile.costs(), engine, shape, requests))


def main() -> int:
    a = parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        for config in a.configs.split(","):
            measured = measure(a, config, rates, Path(d))
            for i, rate in enumerate(rates):
                rows.append({"config": config, "rate": rate, "measured": measured[rate],
                             "predicted": predict(a, config, rate, a.seed + i)})
    print(f"# planner validation: {a.model}, {a.input_len} in / {a.output_len} out, {a.num_requests} requests per "
          f"rate, Poisson arrivals, seeds {a.seed}.. (one per rate); profile {a.profile}; dispatch {a.dispatch_ms} ms")
    print("command: python " + " ".join(sys.argv))
    print()
    print("| config | rate | TTFT p50 pred / meas ms | err | TTFT p90 pred / meas | err | TPOT p50 pred / meas ms | "
          "err | TPOT p90 pred / meas | err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = [r["config"], f"{r['rate']:g}"]
        for metric in ("ttft_s", "tpot_s"):
            for stat in ("median", "p90"):
                pv, mv = r["predicted"][metric][stat], r["measured"][metric][stat]
                err = (pv - mv) / mv if pv is not None and mv else None
                cells += [f"{pv * 1000:.1f} / {mv * 1000:.1f}" if pv is not None and mv is not None else "-",
                          "-" if err is None else f"{err:+.0%}"]
        print("| " + " | ".join(cells) + " |")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
