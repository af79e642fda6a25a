"""What an idle `pdserve serve` costs the machine: CPU per process group (bench/proc_cpu.py)
while no request is served, for the server as shipped and for variants of its environment,
alternating. On a small CPU node this background comes out of the engines' cores under load
(docs/performance.md "What an idle server costs": each % of a core of it costs a two-thread
engine more than 1%).

    python bench/idle_cost.py [--model DIR] [--rounds 2] [--window 30]
        [--variant 'ray-defaults=RAY_event_stats=1,RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=100']

A variant's variables are set in `pdserve serve`'s environment; cluster/local_env.py's LOCAL_ENV only
fills in what is not set, so a variant can put back Ray's own defaults.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from proc_cpu import cpu_snapshot, cpu_table  # bench/ is on sys.path when run as a script
from served import PDSERVE, start, stop, wait_healthy


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'NAME=K1=V1,K2=V2' -> (NAME, {K1: V1, K2: V2})."""
    name, _, assignments = text.partition("=")
    env = dict(item.split("=", 1) for item in assignments.split(",") if item)
    if not name or not env:
        raise SystemExit(f"--variant {text!r}: expected NAME=KEY=VALUE[,KEY=VALUE...]")
    return name, env


def idle(a: argparse.Namespace, name: str, env: dict[str, str]) -> dict[str, float]:
    """One server up, settled, then `--window` seconds of CPU accounting; the server stopped.
    Groups under 0.5% of a core are left out of the table (proc_cpu.cpu_table)."""
    log = Path(a.log_dir) / f"idle_cost_{name.replace(' ', '_')}.log"
    print(f"[idle] {name}: starting the server ...", file=sys.stderr, flush=True)
    server = start([PDSERVE, "serve", "--model", a.model, "--mode", a.mode, "--port", str(a.port)], log, env)
    try:
        wait_healthy(f"http://127.0.0.1:{a.port}", server, log)
        time.sleep(a.settle)  # the gateway's and workers' start-up work done
        before, t0 = cpu_snapshot(), time.monotonic()
        time.sleep(a.window)
        return cpu_table(before, cpu_snapshot(), time.monotonic() - t0)
    finally:
        stop(server)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--mode", default="colocated")
    p.add_argument("--variant", action="append", default=[], help="NAME=KEY=VALUE[,KEY=VALUE...] (repeatable)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--window", type=float, default=30.0, help="seconds of accounting per server")
    p.add_argument("--settle", type=float, default=12.0, help="seconds after /health before the window")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-dir", default="/tmp")
    a = p.parse_args()
    variants = [("as shipped", {}), *(parse_variant(v) for v in a.variant)]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in variants}
    for r in range(a.rounds):
        for name, env in variants:
            table = idle(a, name, env)
            runs[name].append(table)
            total = sum(v for k, v in table.items() if k != "machine")
            print(f"[idle] round {r + 1}, {name}: processes {total:.1f}% of a core, machine {table['machine']}%",
                  file=sys.stderr, flush=True)
    groups = sorted({g for tables in runs.values() for t in tables for g in t if g != "machine"},
                    key=lambda g: -statistics.median(t.get(g, 0.0) for t in runs["as shipped"]))
    print(f"\n# idle `pdserve serve --model {a.model} --mode {a.mode}`: % of one core, median of {a.rounds} "
          f"rounds of {a.window:.0f} s\ncommand: {' '.join(sys.argv)}\n")
    print("| group | " + " | ".join(name for name, _ in variants) + " |")
    print("|---|" + "---:|" * len(variants))
    for g in [*groups, "all processes", "machine"]:
        cells = []
        for name, _ in variants:
            if g == "all processes":
                values = [sum(v for k, v in t.items() if k != "machine") for t in runs[name]]
            else:
                values = [t.get(g, 0.0) for t in runs[name]]
            cells.append(f"{statistics.median(values):.1f}")
        print(f"| {g} | " + " | ".join(cells) + " |")
    for name, env in variants[1:]:
        print(f"\n{name}: " + " ".join(f"{k}={v}" for k, v in env.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
