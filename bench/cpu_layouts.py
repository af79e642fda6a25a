"""Where pdserve's processes run on a small CPU node, and what it does to served throughput
(cluster/cpu_pinning.py). One `pdserve serve --cpu-pinning off` (1 prefill + 1 decode) is
started; before each run this script sets the CPU affinity of its processes (by pid, only
ours) to one of the layouts below; vLLM's bench client (random dataset, EOS ignored,
unpinned) then loads it. Layouts alternate, `--rounds` times; medians per layout.

Layouts, on a node of N cores (the decode worker's share is its torch threads, from the top):
  unpinned        every process on every core
  engines apart   decode on its cores, prefill on the others, the serving plane anywhere
                  (what `--cpu-pinning auto` does)
  decode alone    decode on its cores, everything else on the others
  engines shared  both engines on the decode cores, everything else on the others
  decode first    decode on its cores at nice -10 (needs CAP_SYS_NICE), everything else anywhere:
                  the others take the decode cores only while the decode worker waits
  others behind   decode on its cores, everything else anywhere at nice 10 or more (no privilege)
  plane behind    decode on its cores, prefill on the others, the serving plane anywhere at nice 10
  gateway with decode  decode and the gateway replica on the decode cores, everything else on the others
  gateway anywhere     decode on its cores, the gateway replica on every core, everything else on the others

    python bench/cpu_layouts.py [--model tiny] [--rounds 3] [--concurrency 16] [--num-prompts 320]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from served import PDSERVE, start, stop, wait_healthy
from vs_vllm import add_vllm_venv_arg, bench, model_dir, vllm_bin

from pdserve.cluster.background_priority import descendants
from pdserve.cluster.cpu_pinning import set_affinity

LAYOUTS = ("unpinned", "engines apart", "decode alone", "engines shared",
           "decode first", "others behind", "plane behind", "gateway with decode",
           "gateway anywhere")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


_NICE: dict[int, int] = {}  # each thread's nice value before the first layout


def renice(pid: int, nice: int | None) -> None:
    """Every thread of `pid` to `nice`; None: back to its nice before the first layout."""
    for tid in (int(t) for t in os.listdir(f"/proc/{pid}/task")):
        try:
            _NICE.setdefault(tid, os.getpriority(os.PRIO_PROCESS, tid))
            os.setpriority(os.PRIO_PROCESS, tid, _NICE[tid] if nice is None else nice)
        except OSError:
            continue  # it ended


def arrange(server: int, layout: str, cores: list[int], decode_threads: int) -> None:
    """Set every process below `server` (and it) to its cores and nice values under `layout`."""
    top, low = frozenset(cores[-decode_threads:]), frozenset(cores[:-decode_threads])
    every = frozenset(cores)
    for pid in [server, *descendants(server)]:
        cmd = cmdline(pid)
        kind = ("decode" if "DecodeService" in cmd else "prefill" if "PrefillService" in cmd
                else "gateway" if "ServeReplica" in cmd else "plane")
        table = {"unpinned": {"decode": every, "prefill": every, "plane": every},
                 "engines apart": {"decode": top, "prefill": low, "plane": every},
                 "decode alone": {"decode": top, "prefill": low, "plane": low},
                 "engines shared": {"decode": top, "prefill": top, "plane": low},
                 "decode first": {"decode": top, "prefill": every, "plane": every},
                 "others behind": {"decode": top, "prefill": every, "plane": every},
                 "plane behind": {"decode": top, "prefill": low, "plane": every},
                 "gateway with decode": {"decode": top, "prefill": low, "gateway": top, "plane": low},
                 "gateway anywhere": {"decode": top, "prefill": low, "gateway": every, "plane": low}}[layout]
        where = table.get(kind, table["plane"])  # the gateway goes with the serving plane unless said
        set_affinity(pid, where)
        with contextlib.suppress(OSError):
            if layout == "decode first" and kind == "decode":
                renice(pid, -10)
            elif ((layout == "others behind" and kind != "decode")
                  or (layout == "plane behind" and kind in ("plane", "gateway"))):
                renice(pid, max(10, _NICE.get(pid, 0)))
            else:
                renice(pid, None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    add_vllm_venv_arg(p)  # the client only: `vllm bench serve`
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=320)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--layouts", default=",".join(LAYOUTS[:4]),
                   help="comma-separated, of the above (default: the first four)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `pdserve serve` argument (repeatable)")
    a = p.parse_args()
    layouts = [name.strip() for name in a.layouts.split(",")]
    if unknown := set(layouts) - set(LAYOUTS):
        raise SystemExit(f"--layouts: unknown {sorted(unknown)}; known: {', '.join(LAYOUTS)}")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs at least two cores")
    decode_threads = max(1, len(cores) // 2)  # split sharing's share for 1P+1D
    vllm_bin(a.vllm_venv)  # before a server starts: say now if the client is missing
    mdir = model_dir(a.model)
    tmp = Path(tempfile.mkdtemp(prefix="cpu-layouts-"))
    log = tmp / "pdserve.log"
    server = start([PDSERVE, "serve", "--model", mdir, "--port", str(a.port), "--cpu-pinning", "off",
                    "--cpu-sharing", "split", *a.serve_arg], log)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in layouts}
    try:
        wait_healthy(f"http://127.0.0.1:{a.port}", server, log)
        warm = argparse.Namespace(**{**vars(a), "num_prompts": 2 * a.concurrency})
        bench(warm, a.port, mdir, 999, tmp / "warm.json")
        for i in range(a.rounds):
            for layout in layouts:
                print(f"[cpu-layouts] round {i + 1}/{a.rounds}: {layout} ...", file=sys.stderr, flush=True)
                arrange(server.pid, layout, cores, decode_threads)
                runs[layout].append(bench(a, a.port, mdir, i, tmp / f"{layout.replace(' ', '-')}-{i}.json", server))
    finally:
        stop(server)

    def med(layout: str, key: str) -> float:
        return statistics.median(float(r[key]) for r in runs[layout])

    print(f"# pdserve 1P+1D, {a.model}, random {a.input_len}/{a.output_len}, concurrency {a.concurrency}, "
          f"{a.num_prompts} prompts, vLLM's bench client; {len(cores)} cores, decode on {decode_threads}; "
          f"{a.rounds} alternating rounds (medians)")
    print("command: python " + " ".join(sys.argv) + "\n")
    print("| layout | output tok/s (runs) | median | TPOT p50 ms | TTFT p50 ms | server CPU ms/token |")
    print("|---|---|---:|---:|---:|---:|")
    for layout in layouts:
        tps = ", ".join(f"{float(r['output_throughput']):.0f}" for r in runs[layout])
        cpu = statistics.median(1000 * float(r["server_cpu_s"]) / max(1, int(r["total_output_tokens"]))
                                for r in runs[layout])
        print(f"| {layout} | {tps} | {med(layout, 'output_throughput'):.0f} | {med(layout, 'median_tpot_ms'):.1f} | "
              f"{med(layout, 'median_ttft_ms'):.0f} | {cpu:.2f} |")
    print(f"\n(logs and results: {tmp})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
