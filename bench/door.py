"""The front door apart from the engine (issue 47): CPU per streamed token of the gateway tier
over real HTTP, with workers that make tokens as fast as asked (bench/fake_worker.py, no model).

Local Ray starts as `pdserve serve` starts it (cluster/serve_app.py: HAProxy ingress, LOCAL_ENV),
fake workers take the colocated workers' names, and the real `gateway_app(cfg)` serves in front
of them, `--replicas` replicas of it. A client in a process of its own (aiohttp, through
cluster/bench/client.py `send`) keeps `--concurrency` streamed /v1/completions (ignore_eos,
`--tokens` each) open for `--requests` requests. Over exactly that load, every process this
script started is read from /proc (utime + stime): the gateway replicas, HAProxy, the fake
workers, the client, and the rest (Ray's raylet, GCS, Serve's controller, idle workers, this
script) as "ray+other". Each row: streamed chunks/s and tokens/s, CPU in us per streamed token
per process group, the gateway replicas' cores in use, and tokens/s per gateway core. "machine"
is how busy all the machine's cores were, anyone's processes included (a shared machine shows
here).

Each stream is checked against what the fakes made: `--tokens` tokens (usage) and [DONE] in
every one, one stream's text whole, and the fakes' own count of tokens sent equal to what the
client received.

    python bench/door.py [--replicas 1,2] [--concurrency 16] [--tokens 64] [--requests 480]
        [--repeats 3] [--step-ms 0] [--workers 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import fake_worker  # bench/ is on sys.path when run as a script
from fake_worker import FAKE_TEXT
from machine import cpu_name
from proc_cpu import cpu_snapshot
from proc_cpu import group_of as proc_group

GROUPS = ("gateway", "haproxy", "workers", "client", "ray+other")
PROMPT = "hello world"
_REQUEST_TIMEOUT_S = 120.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="whose tokenizer the gateway loads (the fakes need no model)")
    p.add_argument("--replicas", default="1,2", help="gateway replica counts, comma-separated (alternated)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64, help="max_tokens of every request (ignore_eos)")
    p.add_argument("--requests", type=int, default=480, help="timed requests per run (after a warm-up)")
    p.add_argument("--repeats", type=int, default=3, help="runs per replica count; the table has their medians")
    p.add_argument("--step-ms", type=float, default=0.0, help="the fakes' step period (0: back to back)")
    p.add_argument("--workers", type=int, default=1, help="fake workers")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="the gateway's --stream-interval: tokens a chunk gathers after the first")
    p.add_argument("--json", type=Path, default=None, help="every run's figures and records")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the client process: the gateway's URL
    a = p.parse_args(argv)
    for name in ("concurrency", "tokens", "requests", "repeats", "workers", "stream_interval"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    return a


# -- the client (a process of its own: `door.py --client URL`) ---------------------------------


async def _client(a: argparse.Namespace) -> dict[str, Any]:
    """Warm up; the timed load between the `start` and `end` lines on stdout (the driver reads
    every process's CPU at each); then one stream read whole for its text."""
    import aiohttp

    from pdserve.cluster.bench.client import Endpoint, RequestRecord, request_body, send

    url = f"{a.client}/v1/completions"
    body = request_body(Endpoint.COMPLETIONS, a.model, PROMPT, a.tokens, ignore_eos=True)

    async def load(session: aiohttp.ClientSession, n: int) -> list[RequestRecord]:
        gate, t0 = asyncio.Semaphore(a.concurrency), time.perf_counter()

        async def one(i: int) -> RequestRecord:
            async with gate:
                return await send(session, url, body, _REQUEST_TIMEOUT_S, RequestRecord(i, 0, a.tokens, 0.0), t0)

        return list(await asyncio.gather(*(one(i) for i in range(n))))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=a.concurrency)) as session:
        warm = await load(session, 2 * a.concurrency)
        print("start", flush=True)
        t0 = time.perf_counter()
        records = await load(session, a.requests)
        wall = time.perf_counter() - t0
        print("end", flush=True)
        text, sample_tokens = await _one_text(session, url, body)
    return {"wall_s": wall, "records": [_without_itl(dataclasses.asdict(r)) for r in records],
            "warm_failed": sum(not r.success for r in warm), "sample_text": text,
            "errors": sorted({str(r.error) for r in warm + records if not r.success})[:5],
            "tokens_received": sum(r.output_tokens for r in warm + records) + sample_tokens}


def _without_itl(record: dict[str, Any]) -> dict[str, Any]:
    """A record without its gaps between chunks (the JSON would hold every one)."""
    return {k: v for k, v in record.items() if k != "itl"}


async def _one_text(session: Any, url: str, body: Any) -> tuple[str, int]:
    """One stream's text, its chunks' texts joined, and its usage's token count; ("", 0)
    unless it ended with [DONE]."""
    text, tokens = "", 0
    async with asyncio.timeout(_REQUEST_TIMEOUT_S), session.post(url, json=body) as r:
        async for line in r.content:
            if not line.startswith(b"data:"):
                continue
            data = line.removeprefix(b"data:").strip()
            if data == b"[DONE]":
                return text, tokens
            event = json.loads(data)
            text += "".join(c.get("text") or "" for c in event.get("choices") or [])
            tokens = (event.get("usage") or {}).get("completion_tokens") or tokens
    return "", 0


def client_main(a: argparse.Namespace) -> int:
    print(json.dumps(asyncio.run(_client(a))), flush=True)
    return 0


# -- the cluster: local Ray, the fakes, the real gateway app -----------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_cfg(a: argparse.Namespace) -> Any:
    """A colocated ServeConfig on free ports (other runs may share this machine)."""
    from pdserve.cluster.serve_config import serve_config

    ports = {name: _free_port() for name in ("port", "haproxy_metrics_port", "haproxy_stats_port",
                                              "haproxy_fallback_port")}
    settings = {"model": a.model, "mode": "colocated", "workers": a.workers, "cpu_pinning": "off", **ports}
    if a.stream_interval != 1:  # only when asked: a ServeConfig from before the setting has no such field
        settings["stream_interval"] = a.stream_interval
    return serve_config(settings)


def with_replicas(cfg: Any, n: int) -> Any:
    """`cfg` with `n` gateway replicas; the field's default where this ServeConfig has none yet
    (then only 1 can be measured)."""
    if any(f.name == "gateway_replicas" for f in dataclasses.fields(cfg)):
        return dataclasses.replace(cfg, gateway_replicas=n)
    if n != 1:
        raise SystemExit("--replicas: this ServeConfig has no gateway_replicas field; only 1 can be measured")
    return cfg


def start_cluster(cfg: Any, step_ms: float) -> list[Any]:
    """Local Ray as serve_app.run starts it, and the fake workers under the workers' names."""
    import ray
    from ray import cloudpickle

    from pdserve.cluster import serve_app

    cloudpickle.register_pickle_by_value(fake_worker)  # Ray's workers cannot import bench/
    serve_app.preflight(cfg)
    serve_app.init_ray(cfg, log_to_driver=False)
    fakes = [fake_worker.FakeWorkerActor.options(name=name, namespace=serve_app.NAMESPACE, num_cpus=0.01)
             .remote(name, step_ms, cfg.cluster_secret) for name in cfg.worker_names()]
    ray.get([f.info.remote() for f in fakes], timeout=120)
    return fakes


def deploy(cfg: Any, replicas: int) -> None:
    """The real gateway app with `replicas` replicas (the last one's deleted first), as
    serve_app.run deploys it, and until it answers."""
    from ray import serve

    from pdserve.cluster import serve_app
    from pdserve.cluster.background_priority import deprioritize_background

    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.delete("pdserve")
    serve.run(serve_app.gateway_app(with_replicas(cfg, replicas)), name="pdserve", route_prefix="/")
    deprioritize_background(cfg.control_plane_nice, proxy_is_ingress=False)
    deadline, processes = time.monotonic() + 300, 0
    while time.monotonic() < deadline:
        processes = len(pids_of_group("gateway"))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{cfg.port}/health", timeout=5) as r:
                if r.status == 200 and processes == replicas:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"the gateway did not answer from {replicas} replica process(es) in 300 s ({processes} seen: "
                     "a gateway_app that ignores gateway_replicas runs one)")


# -- CPU per process group, from /proc ---------------------------------------------------------


def pids_of_group(group: str, fakes: frozenset[str] = frozenset(), client: str = "") -> list[str]:
    """This script's descendants in `group` (see `group_of`), by pid."""
    from pdserve.cluster.background_priority import descendants

    mine = {str(p) for p in descendants(os.getpid())}
    return [pid for pid, (cmd, _) in cpu_snapshot()[0].items()
            if pid in mine and group_of(pid, cmd, fakes, client) == group]


def group_of(pid: str, cmd: str, fakes: frozenset[str], client: str) -> str:
    if pid == client:
        return "client"
    if pid in fakes:
        return "workers"
    return {"ServeReplica": "gateway", "haproxy": "haproxy"}.get(proc_group(cmd), "ray+other")


def snapshot() -> tuple[Any, set[str]]:
    """Every process's CPU time now (proc_cpu.cpu_snapshot), and which are this script and its descendants."""
    from pdserve.cluster.background_priority import descendants

    return cpu_snapshot(), {str(p) for p in descendants(os.getpid())} | {str(os.getpid())}


def cpu_by_group(before: Any, after: Any, mine: set[str], fakes: frozenset[str], client: str) -> dict[str, float]:
    """CPU seconds each group of this script's processes `mine` took between the snapshots,
    and "machine": busy seconds of all the machine's cores."""
    (p0, total0, idle0), (p1, total1, idle1) = before, after
    out = dict.fromkeys(GROUPS, 0.0)
    for pid, (cmd, t) in p1.items():
        if pid in mine:  # by pid: Ray retitles a worker as it runs tasks
            out[group_of(pid, p0.get(pid, (cmd, 0.0))[0], fakes, client)] += t - p0.get(pid, ("", 0.0))[1]
    out["machine"] = (total1 - total0) - (idle1 - idle0)
    return out


# -- one run, the table ------------------------------------------------------------------------


def one_run(a: argparse.Namespace, cfg: Any, fakes: list[Any], replicas: int) -> dict[str, Any]:
    """One client's load against the deployed gateway, CPU read at its `start` and `end`."""
    import ray

    infos = ray.get([f.info.remote() for f in fakes], timeout=60)
    fake_pids = frozenset(str(i.pid) for i in infos)
    sent0 = sum(t for _, t in ray.get([f.counts.remote() for f in fakes], timeout=60))
    cmd = [sys.executable, __file__, "--client", f"http://127.0.0.1:{cfg.port}", "--model", cfg.served_names[0],
           "--concurrency", str(a.concurrency), "--tokens", str(a.tokens), "--requests", str(a.requests)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        if proc.stdout.readline().strip() != "start":
            raise SystemExit("the client failed before its load")
        (before, _), t0 = snapshot(), time.monotonic()
        if proc.stdout.readline().strip() != "end":
            raise SystemExit("the client failed during its load")
        (after, mine), wall = snapshot(), time.monotonic() - t0
        result = json.loads(proc.stdout.readline())
        proc.wait(timeout=_REQUEST_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    sent = sum(t for _, t in ray.get([f.counts.remote() for f in fakes], timeout=60)) - sent0
    cpu = cpu_by_group(before, after, mine, fake_pids, str(proc.pid))
    recs = result["records"]
    tokens, chunks = sum(r["output_tokens"] for r in recs), sum(r["chunks"] for r in recs)
    return {"replicas": replicas, "gateway_processes": len(pids_of_group("gateway")), "wall_s": wall,
            "tokens": tokens, "chunks": chunks, "cpu_s": cpu, "tokens_sent_by_fakes": sent,
            "tokens_received": result["tokens_received"], "sample_text": result["sample_text"],
            "failed": sum(not r["success"] for r in recs) + result["warm_failed"], "errors": result["errors"],
            "short": sum(r["output_tokens"] != a.tokens for r in recs), "records": recs}


def figures(run: dict[str, Any]) -> dict[str, float]:
    """What a table row shows of one run."""
    wall, tokens, cpu = run["wall_s"], run["tokens"], run["cpu_s"]
    gw_cores = cpu["gateway"] / wall
    out = {"chunks/s": run["chunks"] / wall, "tokens/s": tokens / wall, "tokens/chunk": tokens / max(run["chunks"], 1)}
    out |= {f"{g} us/token": cpu[g] / tokens * 1e6 for g in GROUPS}
    out |= {"gateway us/chunk": cpu["gateway"] / max(run["chunks"], 1) * 1e6, "gateway cores": gw_cores,
            "tokens/s per gateway core": tokens / wall / gw_cores if gw_cores else 0.0,
            "machine busy %": cpu["machine"] / wall / (os.cpu_count() or 1) * 100}
    return out


def print_table(a: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    print(f"# the front door: {a.concurrency} streams x {a.tokens} tokens, {a.requests} requests a run, "
          f"fake workers ({a.workers}, step {a.step_ms:g} ms), HAProxy + gateway over HTTP\n"
          f"command: python {' '.join(sys.argv)}\nmachine: {cpu_name()}, {os.cpu_count()} cores\n")
    print("Medians of each replica count's runs; CPU in us per streamed token (usage tokens) per process group:\n")
    cols = list(figures(runs[0]))
    print("| replicas | runs | " + " | ".join(cols) + " |")
    print("|---:|---:|" + "---:|" * len(cols))
    for n in dict.fromkeys(r["replicas"] for r in runs):
        mine = [figures(r) for r in runs if r["replicas"] == n]
        med = {c: statistics.median(f[c] for f in mine) for c in cols}
        print(f"| {n} | {len(mine)} | " + " | ".join(fmt(c, med[c]) for c in cols) + " |")
    print("\nEach run (tokens/s, tokens/s per gateway core, machine busy %):\n")
    for r in runs:
        f = figures(r)
        print(f"- {r['replicas']} replica(s), {r['gateway_processes']} process(es): {f['tokens/s']:.0f} tok/s, "
              f"{f['tokens/s per gateway core']:.0f} tok/s per gateway core, machine {f['machine busy %']:.0f}% busy, "
              f"{r['failed']} failed")


def fmt(col: str, v: float) -> str:
    """A figure as the tables print it (door_ab.py's too)."""
    return f"{v:.2f}" if col in ("gateway cores", "tokens/chunk") else f"{v:.1f}" if "us/" in col else f"{v:.0f}"


def check(a: argparse.Namespace, run: dict[str, Any]) -> list[str]:
    """What is wrong with a run's streams, against what the fakes made (empty: nothing)."""
    problems = []
    if run["failed"] or run["short"]:
        problems.append(f"{run['failed']} streams failed, {run['short']} ended short of {a.tokens} tokens"
                        + (f" (errors: {'; '.join(run['errors'])})" if run["errors"] else ""))
    if run["sample_text"] != FAKE_TEXT * a.tokens:
        problems.append(f"a stream's text is {run['sample_text'][:60]!r}..., not {FAKE_TEXT!r} x {a.tokens}")
    if run["tokens_sent_by_fakes"] != run["tokens_received"]:
        problems.append(f"the fakes sent {run['tokens_sent_by_fakes']} tokens, the client got {run['tokens_received']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.client is not None:
        return client_main(a)
    import ray
    from ray import serve

    from pdserve.cluster import serve_app

    counts = [int(n) for n in a.replicas.split(",")]
    cfg = serve_cfg(a)
    runs: list[dict[str, Any]] = []
    try:
        fakes = start_cluster(cfg, a.step_ms)
        for i in range(a.repeats):
            for n in counts:
                if i == 0 or len(counts) > 1:
                    deploy(cfg, n)
                print(f"[door] run {i + 1}/{a.repeats}, {n} replica(s) ...", file=sys.stderr, flush=True)
                runs.append(one_run(a, cfg, fakes, n))
                for problem in check(a, runs[-1]):
                    print(f"[door] {problem}", file=sys.stderr, flush=True)
    finally:
        if ray.is_initialized():
            serve.shutdown()
            serve_app.stop_ray(cfg)
    print_table(a, runs)
    if a.json is not None:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "runs": runs}, indent=1))
    return 1 if any(check(a, r) for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
