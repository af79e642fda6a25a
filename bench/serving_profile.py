"""Where the served time goes: CPU per process while `pdserve serve` is under load,
beside the offline engine on the same workload.

For each `--mode`: starts `pdserve serve` (its own process group, stopped
whatever happens), warms it up, then runs `pdserve bench` (random prompts of
`--input-len` tokens, `--output-len` out, EOS ignored, `--concurrency`) and,
over a window in the middle of that run, reads every process's CPU time from
/proc: the table gives each group's share of one core (the decode, prefill or
colocated worker, the gateway replica, Ray's own processes, HAProxy, the bench
client) and how busy the machine was, and, from the workers' own step histograms
(scraped through the gateway's /metrics), each engine's steps per second, mean
step time and the share of the window its engine thread spent stepping. The
load must outlast the window (its first engine steps, 3 s, then `--window`): the table says whether it did.
Per thread of the workers and the gateway replica (/proc/<pid>/task/<tid>/schedstat):
the share of the window it ran, waited in the run queue for a core, or slept.
Then the offline engine (`LLM.generate`,
the same prompts, `max_num_seqs` = concurrency, at each of `--offline-threads` torch
threads) in a child process, for the ratio served / offline.

`--rounds N` repeats all of it N times, served and offline alternating, and adds a table
of each round's figures, their medians and the median of the rounds' ratios: on a noisy
machine one served run and one offline run make a ratio that moves by a fifth from one
sitting to the next. The other tables are the last round's.

    python bench/serving_profile.py [--model tiny] [--modes disaggregated,colocated,colocated:2]
        [--concurrency 16] [--requests 800] [--window 10] [--rounds 1] [--offline-threads 1,2]
        [--out results.json]

py-spy is left out on purpose: sampling six processes at a useful rate takes
a good part of a 2-core machine and changes what it measures (run it by hand
on one process: `py-spy record -p PID -r 100 -d 15 -f raw -o out.txt`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from disagg_vs_colocated import stop, wait_healthy  # bench/ is on sys.path when run as a script
from machine import cpu_name
from proc_cpu import cpu_snapshot, cpu_table, pids_of, thread_snapshot, thread_table

# A busy neighbour (--hog): spins until killed, or until this script is gone whatever ended it.
HOG = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"
PDSERVE = str(Path(sys.executable).parent / "pdserve")  # the console script beside this interpreter


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--tokenizer", default=None, help="for the bench client (default: the model's directory)")
    p.add_argument("--modes", default="disaggregated,colocated,colocated:2",
                   help="comma-separated; colocated:N = N colocated workers (colocated alone: one); "
                        "MODE+FLAG=VALUE[+...] serves MODE with `--FLAG VALUE` (variants side by side)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals at this rate (req/s), concurrency still capping them; default: closed loop")
    p.add_argument("--no-offline", action="store_true", help="skip the offline engine (served tables only)")
    p.add_argument("--offline-threads", default="1,2",
                   help="the offline engine's torch thread counts (comma-separated)")
    p.add_argument("--rounds", type=int, default=1, help="served and offline runs alternating this many times")
    p.add_argument("--requests", type=int, default=800, help="the load must outlast its start, 3 s and --window")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--window", type=float, default=10.0, help="seconds of CPU accounting in the run's middle")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `pdserve serve` argument (repeatable)")
    p.add_argument("--py-spy", action="append", default=[], metavar="GROUP",
                   help="also sample this process group (e.g. ServeReplica, EngineService) with py-spy over the "
                        "window and print where its threads were (repeatable; it costs CPU: compare throughput "
                        "with a run without it)")
    p.add_argument("--renice", action="append", default=[], metavar="GROUP=N",
                   help="before the measured load, set every thread of this process group (e.g. ServeReplica, "
                        "haproxy) to nice N (repeatable; an experiment in giving the engines the cores first)")
    p.add_argument("--isolate", default=None, metavar="GROUP",
                   help="before the measured load, give this process group the last core alone and every other "
                        "process of the server and the client the others (with --serve-arg=--cpu-pinning "
                        "--serve-arg=off): py-spy's samples of a process that waits in a run queue land on "
                        "whatever it was doing when preempted (after a socket write, mostly); alone on a core "
                        "they show where its CPU goes")
    p.add_argument("--client-cores", default=None, metavar="LIST",
                   help="run the bench client on these cores only (e.g. 0: off the engine's core, as a client on "
                        "another machine would be; it still shares the serving plane's)")
    p.add_argument("--hog", type=int, default=0, metavar="N",
                   help="N busy-looping processes at the default priority beside the server during the load "
                        "(a neighbour on a shared node: a batch job, a log shipper)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def renice(group: str, nice: str) -> None:
    """Every thread of every process of `group` to `nice`, up or down."""
    from pdserve.cluster.background_priority import renice_threads

    count = sum(renice_threads(int(pid), int(nice), only_raise=False) for pid in pids_of(group))
    print(f"[profile] {group}: {count} threads at nice {nice}", file=sys.stderr, flush=True)


def isolate(group: str, server: int) -> frozenset[int]:
    """`group`'s processes alone on the last core, the rest of `server`'s tree on the others;
    returns the others (for the client)."""
    from pdserve.cluster.background_priority import descendants
    from pdserve.cluster.cpu_pinning import node_cores, set_affinity

    cores = sorted(node_cores())
    if len(cores) < 2:
        raise SystemExit("--isolate needs two cores or more")
    alone, others = frozenset(cores[-1:]), frozenset(cores[:-1])
    chosen = {int(pid) for pid in pids_of(group)}
    for pid in [server, *descendants(server)]:
        set_affinity(pid, alone if pid in chosen else others)
    print(f"[profile] {group} ({sorted(chosen)}) alone on core {cores[-1]}", file=sys.stderr, flush=True)
    return others


def spy(pid: str, group: str, seconds: float, out: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """py-spy on one process over the window, not pausing it (--nonblocking), idle threads left out."""
    out = out.with_name(f"{out.stem}-{pid}.txt")
    return subprocess.Popen(["py-spy", "record", "-p", pid, "-r", "100", "-d", str(int(seconds)), "-f", "raw",
                             "--threads", "--nonblocking", "-o", str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL), out


def summarize_spy(path: Path, top: int = 25) -> str:
    """Per thread, the share of samples, then the functions (any frame) seen in most samples."""
    if not path.exists():
        return "  (no samples)"
    threads: collections.Counter[str] = collections.Counter()
    frames: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        count = int(n)
        parts = stack.split(";")
        threads[parts[0]] += count
        total += count
        for frame in {_short(f) for f in parts[1:]}:  # inclusive: a function counts once per sample
            frames[frame] += count
        leaves[_short(parts[-1])] += count
    lines = [f"  {n / total:6.1%}  thread {t}" for t, n in threads.most_common(6)]
    lines += ["  inclusive:"] + [f"  {n / total:6.1%}  {f}" for f, n in frames.most_common(top)]
    lines += ["  self:"] + [f"  {n / total:6.1%}  {f}" for f, n in leaves.most_common(top)]
    return "\n".join(lines)


def _short(frame: str) -> str:
    """`function (path/file.py:line)` -> `function (file.py)`."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.split(':')[0].rsplit('/', 1)[-1]})" if where else name


def scrape(port: int) -> dict[tuple[str, str], float]:
    """{(sample name, worker): value} of the workers' step histograms, from the gateway's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")) and "worker" in sample.labels and \
                    ("engine_step_duration" in sample.name or "iteration_" in sample.name):
                out[(sample.name.removeprefix("pdserve:"), sample.labels["worker"])] = sample.value
    return out


def engine_table(s0: dict[tuple[str, str], float], s1: dict[tuple[str, str], float],
                 wall: float) -> dict[str, dict[str, float]]:
    """Per worker over the window: engine steps/s, mean step ms, the share of the wall time its
    engine thread spent in steps (the rest: waiting), mean decode batch and prefill tokens per step."""
    def delta(name: str, worker: str) -> float:
        return s1.get((name, worker), 0.0) - s0.get((name, worker), 0.0)

    table: dict[str, dict[str, float]] = {}
    for worker in sorted({w for _, w in s1}):
        steps = delta("engine_step_duration_seconds_count", worker)
        busy = delta("engine_step_duration_seconds_sum", worker)
        if steps <= 0:
            continue
        decode_n = delta("iteration_decode_batch_size_count", worker)
        prefill_n = delta("iteration_prefill_tokens_count", worker)
        table[worker] = {
            "steps_per_s": round(steps / wall, 1), "step_ms": round(busy / steps * 1e3, 2),
            "in_steps_pct": round(busy / wall * 100, 1),
            "decode_batch": round(delta("iteration_decode_batch_size_sum", worker) / decode_n, 1) if decode_n else 0.0,
            "prefill_tokens_per_step": round(delta("iteration_prefill_tokens_sum", worker) / prefill_n, 1)
            if prefill_n else 0.0}
    return table


def load_started(port: int, idle: dict[tuple[str, str], float], client: subprocess.Popen[bytes],
                 deadline_s: float) -> None:
    """Until the engines have stepped since `idle` (the client's start: imports, tokenizer,
    prompts, took ~10 s of a slow 2-core machine, and a window opened at a fixed delay
    counted that idle time as the engine's waiting)."""
    def steps(scraped: dict[tuple[str, str], float]) -> float:
        return sum(v for (name, _), v in scraped.items() if name == "engine_step_duration_seconds_count")

    deadline = time.monotonic() + deadline_s
    while steps(scrape(port)) - steps(idle) < 10:
        if client.poll() is not None:
            raise SystemExit(f"the bench client exited ({client.returncode}) before the load started")
        if time.monotonic() > deadline:
            raise SystemExit(f"no engine steps {deadline_s:.0f} s after the bench client started")
        time.sleep(0.5)


def wait_closed(url: str, deadline_s: float) -> None:
    """Until nothing answers at `url` (Ray Serve's proxy outlives `pdserve serve` by a few
    seconds: the next mode's readiness check would see the old server)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=3):
                pass
        except OSError:
            return
        time.sleep(1)
    raise SystemExit(f"the server at {url} still answers {deadline_s:.0f} s after it was stopped")


def bench_cmd(a: argparse.Namespace, url: str, tokenizer: str, n: int, seed: int, out: Path,
              warm_up: bool = False) -> list[str]:
    # The warm-up is a short closed loop whatever the measured load (at a low --request-rate
    # 2 x concurrency requests would take minutes).
    paced = ["--request-rate", str(a.request_rate)] if a.request_rate and not warm_up else []
    concurrency = min(a.concurrency, 8) if warm_up else a.concurrency
    return [PDSERVE, "bench", "--base-url", url, "--input-len", str(a.input_len),
            "--output-len", str(a.output_len), "--range-ratio", "0", "--num-requests", str(n), "--max-concurrency",
            str(concurrency), "--ignore-eos", "--tokenizer", tokenizer, "--seed", str(seed), "--result-json",
            str(out), *paced]


def serve_argv(a: argparse.Namespace, mode: str) -> list[str]:
    """`pdserve serve` for one of --modes: colocated:N = N colocated workers;
    colocated+control-plane-nice=19 adds `--control-plane-nice 19`."""
    base, *variant = mode.split("+")
    name, _, workers = base.partition(":")
    sizes = ["--workers", workers] if workers else []
    extra = [part for flag in variant for part in (f"--{flag.partition('=')[0]}", flag.partition("=")[2])]
    return [PDSERVE, "serve", "--model", a.model, "--mode", name, *sizes, *extra, "--port", str(a.port), *a.serve_arg]


def served(a: argparse.Namespace, mode: str, tokenizer: str, tmp: Path) -> dict[str, Any]:
    url = f"http://127.0.0.1:{a.port}/v1"
    log = (tmp / f"serve-{mode.replace(':', '-')}.log").open("wb")
    server = subprocess.Popen(serve_argv(a, mode), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        print(f"[profile] {mode}: starting the server ...", file=sys.stderr, flush=True)
        try:
            wait_healthy(f"http://127.0.0.1:{a.port}", server, 600)
        except (RuntimeError, TimeoutError) as e:
            log.flush()
            tail = Path(log.name).read_text(errors="replace")[-3000:]
            raise SystemExit(f"[profile] {mode}: {e}; the server's log ends:\n{tail}") from e
        warm = subprocess.run(bench_cmd(a, url, tokenizer, 2 * min(a.concurrency, 8), 100, tmp / "warm.json",
                                        warm_up=True),
                              capture_output=True, text=True, timeout=600)
        if warm.returncode:
            raise SystemExit(f"the warm-up bench failed ({warm.returncode}):\n{warm.stderr[-2000:]}")
        print(f"[profile] {mode}: {a.requests} requests, CPU over {a.window:.0f} s of them ...", file=sys.stderr,
              flush=True)
        result = tmp / f"bench-{mode.replace(':', '-')}.json"
        for spec in a.renice:
            renice(*spec.split("="))
        others = isolate(a.isolate, server.pid) if a.isolate else None
        if a.client_cores is not None:
            others = frozenset(int(c) for c in a.client_cores.split(","))
        scraped_idle = scrape(a.port)
        hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(a.hog)]
        client = subprocess.Popen(bench_cmd(a, url, tokenizer, a.requests, 1, result), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL,
                                  preexec_fn=None if others is None else lambda: os.sched_setaffinity(0, others))
        try:
            load_started(a.port, scraped_idle, client, 120)
        except SystemExit:  # no load: stop what this run started before the server goes
            for proc in (client, *hogs):
                proc.kill()
                proc.wait()
            raise
        time.sleep(3)  # past the ramp-up
        scraped0 = scrape(a.port)
        spies = [spy(pid, group, a.window, tmp / f"py-spy-{mode.replace(':', '-')}-{group}.txt")
                 for group in a.py_spy for pid in pids_of(group)]
        threads0, before, t0 = thread_snapshot(), cpu_snapshot(), time.monotonic()
        time.sleep(a.window)
        after, threads1, wall = cpu_snapshot(), thread_snapshot(), time.monotonic() - t0
        scraped1 = scrape(a.port)
        still_running = client.poll() is None
        if not still_running:  # the CPU and step shares would count idle time after the load
            print(f"[profile] {mode}: the load ended inside the accounting window: its CPU and engine tables "
                  "are not steady-state (raise --requests or lower --window)", file=sys.stderr, flush=True)
        try:
            client.wait(timeout=900)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        for proc, out in spies:
            proc.wait(timeout=60)
            if a.out is not None and out.exists():  # the raw samples, beside the results
                shutil.copy(out, a.out.parent / out.name)
            print(f"[profile] {mode}: py-spy of {out.stem}:\n{summarize_spy(out)}", file=sys.stderr, flush=True)
        metrics = json.loads(result.read_text())["runs"][0]["summary"]
        return {"cpu": cpu_table(before, after, wall), "window_inside_run": still_running, "bench": metrics,
                "engine": engine_table(scraped0, scraped1, wall), "threads": thread_table(threads0, threads1, wall)}
    finally:
        stop(server)
        log.close()
        wait_closed(url, 120)


def offline(a: argparse.Namespace, threads: int) -> float:
    """Output tokens/s of LLM.generate on the same workload, in a child process
    (its own torch thread count, nothing else of this one's)."""
    code = f"""
import time, torch
torch.set_num_threads({threads})
from pdserve import LLM, SamplingParams
llm = LLM({a.model!r}, max_num_seqs={a.concurrency}, progress=False)
g = torch.Generator().manual_seed(1)
vocab = llm.engine.model_config.vocab_size
prompts = [torch.randint(100, vocab, ({a.input_len},), generator=g).tolist() for _ in range({a.requests})]
sp = SamplingParams(temperature=0.0, max_tokens={a.output_len}, ignore_eos=True)
# The warm-up's prompts are not the measured ones: a measured prompt met before would
# be a prefix-cache hit, which the served bench's fresh random prompts never get.
warm = [torch.randint(100, vocab, ({a.input_len},), generator=g).tolist() for _ in range(2 * {a.concurrency})]
llm.generate(warm, sp)
t = time.perf_counter(); llm.generate(prompts, sp); dt = time.perf_counter() - t
print({a.requests} * {a.output_len} / dt)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=1800)
    return float(out.stdout.strip().splitlines()[-1])


def one_round(a: argparse.Namespace, tokenizer: str, threads: list[int]) -> dict[str, Any]:
    """Every mode served, then the offline engine at each thread count (nan: skipped)."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in a.modes.split(","):
            results[mode] = served(a, mode, tokenizer, Path(d))
    for t in threads:
        if a.no_offline:
            results[f"offline_{t}t"] = float("nan")
            continue
        print(f"[profile] offline engine, {t} torch thread(s) ...", file=sys.stderr, flush=True)
        results[f"offline_{t}t"] = offline(a, t)
    return results


def rounds_table(a: argparse.Namespace, rounds: list[dict[str, Any]], threads: list[int]) -> None:
    """Each round's served and offline tok/s, their medians, and the median of the rounds' ratios."""
    modes = a.modes.split(",")
    cols = [*modes, *(f"offline {t}t" for t in threads)]
    ratios = [(m, t) for m in modes for t in threads]
    print("\nRounds (served and offline alternating), output tok/s and served / offline:\n")
    print("| round | " + " | ".join(cols) + " | " + " | ".join(f"{m} / offline {t}t" for m, t in ratios) + " |")
    print("|---|" + "---:|" * (len(cols) + len(ratios)))

    def row(r: dict[str, Any]) -> tuple[list[float], list[float]]:
        tps = [r[m]["bench"]["output_token_throughput"] for m in modes] + [r[f"offline_{t}t"] for t in threads]
        return tps, [r[m]["bench"]["output_token_throughput"] / r[f"offline_{t}t"] for m, t in ratios]

    rows = [row(r) for r in rounds]
    for i, (tps, rat) in enumerate(rows, 1):
        print(f"| {i} | " + " | ".join(f"{v:.1f}" for v in tps) + " | " + " | ".join(f"{v:.3f}" for v in rat) + " |")
    med = [statistics.median(col) for col in zip(*(tps for tps, _ in rows))]
    med_r = [statistics.median(col) for col in zip(*(rat for _, rat in rows))]
    print("| median | " + " | ".join(f"{v:.1f}" for v in med) + " | "
          + " | ".join(f"**{v:.3f}**" for v in med_r) + " |")  # three places: 0.849 is not 0.85


def main() -> int:
    a = parse_args()
    from pdserve.workers.model.resolve import resolve_model

    tokenizer = a.tokenizer or str(resolve_model(a.model))
    threads = [int(t) for t in a.offline_threads.split(",")]
    rounds = []
    for i in range(a.rounds):
        if a.rounds > 1:
            print(f"[profile] round {i + 1}/{a.rounds}", file=sys.stderr, flush=True)
        rounds.append(one_round(a, tokenizer, threads))
        if a.rounds > 1:  # each round as it ends: a later round's failure keeps the earlier ones
            r = rounds[-1]
            print(f"[profile] round {i + 1}: " + ", ".join(
                f"{k} {v['bench']['output_token_throughput'] if isinstance(v, dict) else v:.1f} tok/s"
                for k, v in r.items()), file=sys.stderr, flush=True)
            if a.out:
                a.out.with_suffix(".rounds.json").write_text(json.dumps(rounds, indent=2))
    results = rounds[-1]
    rate = f", Poisson {a.request_rate} req/s" if a.request_rate else ""
    print(f"# served vs offline: {a.model}, {a.input_len} in / {a.output_len} out, concurrency {a.concurrency}{rate}, "
          f"{a.requests} requests\ncommand: python {' '.join(sys.argv)}\nmachine: {cpu_name()}, "
          f"{os.cpu_count()} cores\n")
    print("| mode | output tok/s | " + " | ".join(f"/ offline {t} thread{'s' * (t > 1)}" for t in threads)
          + " | p50 TTFT ms | p50 TPOT ms | failed | window inside the load |")
    print("|---|---:|" + "---:|" * len(threads) + "---:|---:|---:|---|")
    for mode in a.modes.split(","):
        m = results[mode]["bench"]
        tps = m["output_token_throughput"]
        print(f"| {mode} | {tps:.0f} | " + " | ".join(f"{tps / results[f'offline_{t}t']:.2f}" for t in threads)
              + f" | {m['ttft_s']['median'] * 1e3:.0f} | {m['tpot_s']['median'] * 1e3:.1f} | {m['failed']} | "
              f"{'yes' if results[mode]['window_inside_run'] else 'NO'} |")
    for t in threads:
        print(f"| offline, {t} torch thread{'s' * (t > 1)} | {results[f'offline_{t}t']:.0f} |"
              + " |" * (len(threads) + 4))
    if a.rounds > 1 and not a.no_offline:
        rounds_table(a, rounds, threads)
    print("\nCPU during the run, % of one core (machine: busy % of all cores):\n")
    groups = sorted({g for mode in a.modes.split(",") for g in results[mode]["cpu"]},
                    key=lambda g: -max(results[m]["cpu"].get(g, 0.0) for m in a.modes.split(",")))
    print("| process | " + " | ".join(a.modes.split(",")) + " |")
    print("|---|" + "---:|" * len(a.modes.split(",")))
    for g in groups:
        print(f"| {g} | " + " | ".join(f"{results[m]['cpu'].get(g, 0.0):.1f}" for m in a.modes.split(",")) + " |")
    print("\nEngine steps during the same window, per worker (in steps: share of the wall time its engine "
          "thread spent stepping):\n")
    print("| mode | worker | steps/s | mean step ms | in steps % | mean decode batch | prefill tokens/step |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for mode in a.modes.split(","):
        for worker, e in results[mode]["engine"].items():
            print(f"| {mode} | {worker} | {e['steps_per_s']} | {e['step_ms']} | {e['in_steps_pct']} | "
                  f"{e['decode_batch']} | {e['prefill_tokens_per_step']} |")
    print("\nThreads of the workers and the gateway over the same window, % of the wall time: on a CPU, "
          "runnable but waiting for a core (run queue), neither (sleeping or blocked: I/O, a lock, the GIL):\n")
    print("| mode | process | thread | on CPU % | run queue % | off % |")
    print("|---|---|---|---:|---:|---:|")
    for mode in a.modes.split(","):
        for t in results[mode]["threads"]:
            print(f"| {mode} | {t['group']} {t['pid']} | {t['thread']} | {t['on_cpu_pct']} | {t['runqueue_pct']} | "
                  f"{t['off_pct']} |")
    if a.out:
        a.out.write_text(json.dumps(results if a.rounds == 1 else {**results, "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
