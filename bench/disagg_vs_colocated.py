"""Disaggregated vs colocated serving on the same workers, through HTTP, with `pdserve bench`.

For each mode: start `pdserve serve` (local Ray, 1 prefill + 1 decode worker,
or 2 colocated workers: the same total CPUs), warm it up, run `pdserve bench`
on a prefill-heavy mixed workload (1,024-token prompts, 128 output tokens by
default) at each `--rates` (Poisson arrivals), scrape the gateway's /metrics,
stop the server. Then one table side by side: p50/p99 TTFT, TPOT, ITL,
goodput, and the ratio of p99 ITL (disaggregated / colocated), the
interference that disaggregation exists to remove.

    python bench/disagg_vs_colocated.py [--rates 1,2,3] [--num-requests 48] [--out-dir DIR]

Writes DIR/<mode>.json (pdserve bench's JSON), DIR/<mode>/ (its PNGs),
DIR/<mode>_metrics.txt (the server's scrape), DIR/summary.md and DIR/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from machine import cpu_name

MODES = ("colocated", "disaggregated")


def wait_healthy(url: str, proc: subprocess.Popen[bytes], deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {deadline_s:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT runs serve's shutdown (Serve, the worker actors, local Ray); then the group is killed."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def run_mode(mode: str, a: argparse.Namespace, out: Path) -> dict:
    url = f"http://127.0.0.1:{a.port}"
    sizes = ["--workers", "2"] if mode == "colocated" else ["--prefill", "1", "--decode", "1"]  # the same CPUs
    serve = [sys.executable, "-m", "pdserve", "serve", "--mode", mode, *sizes,
             "--port", str(a.port), "--max-model-len", str(a.input_len + a.output_len + 64),
             "--max-num-batched-tokens", str(a.max_num_batched_tokens), *a.serve_args]
    log = open(out / f"{mode}_serve.log", "w")
    print(f"[bench] {mode}: {' '.join(serve)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url, proc, a.start_timeout)
        def bench(seed: int, *extra: str) -> list[str]:
            return [sys.executable, "-m", "pdserve", "bench", "--base-url", f"{url}/v1", "--input-len",
                    str(a.input_len), "--output-len", str(a.output_len), "--seed", str(seed),
                    "--goodput", f"ttft:{a.slo_ttft_ms}", f"tpot:{a.slo_tpot_ms}", "--no-progress", *extra]

        # Warm-up (shapes, allocator, Ray's first calls), with other prompts than the runs', not reported.
        subprocess.run(bench(a.seed + 1000, "--num-requests", "4", "--request-rate", "inf"),
                       check=True, stdout=subprocess.DEVNULL, timeout=a.run_timeout)
        subprocess.run(bench(a.seed, "--num-requests", str(a.num_requests), "--sweep", a.rates,
                             "--result-json", str(out / f"{mode}.json"), "--plot-dir", str(out / mode)),
                       check=True, timeout=a.run_timeout * len(a.rates.split(",")))
        (out / f"{mode}_metrics.txt").write_text(httpx.get(f"{url}/metrics", timeout=10).text)
    finally:
        stop(proc)
        log.close()
    return json.loads((out / f"{mode}.json").read_text())


def table(results: dict[str, dict]) -> tuple[str, list[dict]]:
    rows = [{"mode": mode, "rate": run["request_rate"], "summary": run["summary"]}
            for mode, res in results.items() for run in res["runs"]]
    lines = ["| mode | rate req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p50 ms | ITL p99 ms "
             "| output tok/s | goodput req/s | SLO attainment |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        s = r["summary"]

        def ms(metric: str, q: str) -> str:
            v = s[metric][q]
            return "-" if v is None else f"{1000 * v:.1f}"

        g = s.get("goodput") or {}
        lines.append(f"| {r['mode']} | {r['rate']} | {ms('ttft_s', 'p50')} | {ms('ttft_s', 'p99')} "
                     f"| {ms('tpot_s', 'p50')} | {ms('tpot_s', 'p99')} | {ms('itl_s', 'p50')} | {ms('itl_s', 'p99')} "
                     f"| {s['output_token_throughput'] or 0:.0f} | {g.get('request_goodput') or 0:.2f} "
                     f"| {g.get('attainment') or 0:.0%} |")
    return "\n".join(lines), rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1,2,3")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000)
    ap.add_argument("--slo-tpot-ms", type=float, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--run-timeout", type=float, default=900)
    ap.add_argument("--out-dir", default="bench/results/disagg_vs_colocated")
    ap.add_argument("serve_args", nargs="*", help="more `pdserve serve` flags, after --")
    a = ap.parse_args()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cpu = cpu_name()
    results = {mode: run_mode(mode, a, out) for mode in a.modes.split(",")}
    text, rows = table(results)
    header = (f"# disaggregated vs colocated\ncommand: python {' '.join(sys.argv)}\n"
              f"machine: {cpu}, {os.cpu_count()} cores\nworkload: {a.input_len}-token prompts, {a.output_len} output "
              f"tokens, Poisson arrivals, {a.num_requests} requests per rate; SLO TTFT {a.slo_ttft_ms:.0f} ms, "
              f"TPOT {a.slo_tpot_ms:.0f} ms\n")
    ratios = []
    if set(results) == set(MODES):
        by = {(r["mode"], r["rate"]): r["summary"] for r in rows}
        for rate in sorted({r["rate"] for r in rows}, key=float):
            d, c = by.get(("disaggregated", rate)), by.get(("colocated", rate))
            if d and c and d["itl_s"]["p99"] and c["itl_s"]["p99"]:
                ratios.append(f"rate {rate} req/s: p99 ITL disaggregated / colocated = "
                              f"{d['itl_s']['p99'] / c['itl_s']['p99']:.2f}")
    report = header + "\n" + text + "\n\n" + "\n".join(ratios) + "\n"
    print(report)
    (out / "summary.md").write_text(report)
    (out / "summary.json").write_text(json.dumps(rows, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
