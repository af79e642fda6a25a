"""A load shift under --autoscale-roles (issue 18): short prompts, then long ones.

Starts `pdserve serve` with 1 prefill + 2 decode workers, the planner loop on a
profile and SLOs, `--autoscale-roles`; then runs `pdserve bench`:

  1. short prompts (decode-heavy: the split suits them),
  2. long prompts "before": one prefill worker cannot keep up, TTFT misses its SLO,
  3. waits until the planner has moved a worker (its decisions in /metrics),
  4. long prompts "after", on the new split.

and prints, per phase, the split it started and ended on, TTFT/TPOT p50/p90 and the
SLO attainment the bench measured, with the planner's log lines. The server's process
group is killed whatever happens.

    python bench/autoscale_roles.py --profile bench/results/profile_tiny_2026-11-27.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from served import PDSERVE, profile_dtype, start, stop, wait_healthy


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True)
    p.add_argument("--model", default="tiny")
    p.add_argument("--slo", default="ttft:400 tpot:100")
    p.add_argument("--interval", type=float, default=30.0, help="--planner-interval")
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--short", default="128:64", help="input:output tokens of the short phase")
    p.add_argument("--long", default="1536:16", help="input:output tokens of the long phases")
    p.add_argument("--seconds", type=float, default=28.0, help="length of each phase's load")
    p.add_argument("--port", type=int, default=8000)
    return p.parse_args()


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def split(url: str) -> str:
    t = get(f"{url}/metrics")
    p = metric(t, "pdserve:pool_workers_configured", '{pool="prefill"}')
    d = metric(t, "pdserve:pool_workers_configured", '{pool="decode"}')
    return f"{p:.0f}P+{d:.0f}D"


def bench(a: argparse.Namespace, url: str, lengths: str, seed: int, out: Path) -> dict[str, Any]:
    inp, outp = lengths.split(":")
    n = max(1, int(a.rate * a.seconds))
    cmd = [PDSERVE, "bench", "--base-url", f"{url}/v1", "--input-len", inp, "--output-len", outp, "--range-ratio",
           "0", "--num-requests", str(n), "--request-rate", str(a.rate), "--ignore-eos", "--seed", str(seed),
           "--goodput", *a.slo.split(), "--result-json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"pdserve bench failed ({done.returncode}):\n{done.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads(out.read_text())["runs"][0]["summary"]
    return summary


def main() -> int:
    a = parse_args()
    url = f"http://127.0.0.1:{a.port}"
    rows: list[tuple[str, str, str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as d:
        log_path = Path(d) / "serve.log"
        server = start(
            [PDSERVE, "serve", "--model", a.model, "--prefill", "1", "--decode", "2", "--port", str(a.port),
             "--planner-profile", a.profile, "--slo", *a.slo.split(), "--planner-interval", str(a.interval),
             "--autoscale-roles", "--dtype", profile_dtype(a.profile)], log_path)
        try:
            wait_healthy(url, server, log_path, 600)
            for phase, lengths, seed in (("short prompts", a.short, 1), ("long prompts, before", a.long, 2)):
                before = split(url)
                print(f"[autoscale] {phase} ({lengths}) at {a.rate} req/s on {before} ...", file=sys.stderr, flush=True)
                rows.append((phase, before, "", bench(a, url, lengths, seed, Path(d) / f"{seed}.json")))
                rows[-1] = (phase, before, split(url), rows[-1][3])
            deadline = time.monotonic() + 3 * a.interval + 120
            while metric(get(f"{url}/metrics"), "pdserve:planner_decisions_total", '{decision="applied"}') < 1:
                if time.monotonic() > deadline:
                    print("[autoscale] the planner moved no worker", file=sys.stderr)
                    break
                time.sleep(1)
            after = split(url)
            print(f"[autoscale] long prompts, after ({a.long}) on {after} ...", file=sys.stderr, flush=True)
            s = bench(a, url, a.long, 3, Path(d) / "3.json")
            rows.append(("long prompts, after", after, split(url), s))
            metrics_text = get(f"{url}/metrics")
        finally:
            stop(server)
        planner_lines = [ln for ln in log_path.read_text(errors="replace").splitlines()
                         if "planner:" in ln or "role" in ln.lower() and "switch" in ln.lower()]
    print(f"# --autoscale-roles under a load shift: {a.model}, {a.rate} req/s, SLO {a.slo}, planner window "
          f"{a.interval:g} s, profile {a.profile}")
    print("command: python " + " ".join(sys.argv))
    print()
    print("| phase | split at start | at end | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms "
          "| SLO attainment | failed |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for phase, split_start, split_end, s in rows:
        att = (s.get("goodput") or {}).get("attainment")
        print(f"| {phase} | {split_start} | {split_end} | {s['ttft_s']['median'] * 1000:.0f} | "
              f"{s['ttft_s']['p90'] * 1000:.0f} | "
              f"{s['tpot_s']['median'] * 1000:.1f} | {s['tpot_s']['p90'] * 1000:.1f} | "
              f"{'-' if att is None else f'{att:.0%}'} | {s['failed']} |")
    print()
    decisions = {k: metric(metrics_text, "pdserve:planner_decisions_total", f'{{decision="{k}"}}')
                 for k in ("keep", "recommend", "applied", "failed", "skipped")}
    print("planner decisions:", ", ".join(f"{k} {v:.0f}" for k, v in decisions.items()))
    print("planner log:")
    for ln in planner_lines[-12:]:
        print("   ", ln[-400:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
