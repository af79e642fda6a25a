"""What a small neighbour on the same cores costs the offline engine: `LLM.generate` (random
prompts of `--input-len` tokens, `--output-len` out, EOS ignored, `max_num_seqs` =
`--concurrency`) alone, and beside a process that busy-loops `--busy-ms` then sleeps `--idle-ms`
(the shape of a serving plane's wake-ups: the gateway, Ray's daemons, a client), at nice 0 and
at `--neighbour-nice`. The three alternate `--rounds` times in one engine; the table gives
medians and the ratio to the engine alone.

Why: issue 17's bar compares a served worker with the offline engine on the same cores. On a
2-core node a served engine always has such a neighbour; this says how much of the gap the
neighbour's CPU alone explains, with no HTTP, Ray or client in the way. Its CPU share of one
core is busy / (busy + idle) while it runs at nice 0 (the default: 0.5 / 3.0 ms = 14%, what the
serving plane took beside SmolLM2: docs/performance.md "Served against offline on two cores").

    python bench/experiments/neighbour_cost.py [--model DIR] [--threads 2] [--concurrency 16] [--requests 160]
        [--busy-ms 0.5] [--idle-ms 3.0] [--neighbour-nice 19[,10,idle]] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from pdserve import LLM, SamplingParams

# The neighbour: busy `busy` seconds, asleep `idle`, at nice `nice`, until its parent is gone
# (whatever ended this script) or it is killed.
NEIGHBOUR = """
import os, sys, time
busy, idle, nice = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if nice == "idle":
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
else:
    os.nice(int(nice))
parent = os.getppid()
while os.getppid() == parent:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(idle)
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--busy-ms", type=float, default=0.5)
    p.add_argument("--idle-ms", type=float, default=3.0)
    p.add_argument("--neighbour-nice", default="19",
                   help="comma-separated priorities the neighbour runs at beside nice 0: nice values, or "
                        "`idle` (SCHED_IDLE: it runs only on a core nothing else wants)")
    p.add_argument("--rounds", type=int, default=5)
    return p.parse_args()


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    llm = LLM(a.model, max_num_seqs=a.concurrency, progress=False)
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(1)
    sp = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)

    def prompts(n: int) -> list[list[int]]:  # fresh each call: no prefix-cache hits
        return [torch.randint(100, vocab, (a.input_len,), generator=g).tolist() for _ in range(n)]

    print(f"warming up ({a.threads} threads) ...", file=sys.stderr, flush=True)
    llm.generate(prompts(2 * a.concurrency), sp)
    share = a.busy_ms / (a.busy_ms + a.idle_ms)
    sides: dict[str, str | None] = {"alone": None, f"neighbour at nice 0 ({share:.0%} of a core)": "0"}
    for nice in a.neighbour_nice.split(","):
        sides["neighbour at SCHED_IDLE" if nice == "idle" else f"neighbour at nice {int(nice)}"] = nice
    runs: dict[str, list[float]] = {name: [] for name in sides}
    for rnd in range(a.rounds):
        for name, nice in sides.items():
            neighbour = None if nice is None else subprocess.Popen(
                [sys.executable, "-c", NEIGHBOUR, str(a.busy_ms / 1e3), str(a.idle_ms / 1e3), nice])
            try:
                batch = prompts(a.requests)
                t = time.perf_counter()
                llm.generate(batch, sp)
                runs[name].append(a.requests * a.output_len / (time.perf_counter() - t))
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
            print(f"[round {rnd + 1}/{a.rounds}] {name}: {runs[name][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    alone = statistics.median(runs["alone"])
    print(f"# the offline engine beside a neighbour: {a.model or 'tiny'}, {a.threads} threads, "
          f"{a.input_len}/{a.output_len}, concurrency {a.concurrency}, {a.requests} requests a run")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {os.cpu_count()} CPUs; neighbour busy {a.busy_ms} ms, asleep {a.idle_ms} ms\n")
    print("| engine | tok/s (runs) | median | / alone |")
    print("|---|---|---:|---:|")
    for name, values in runs.items():
        med = statistics.median(values)
        print(f"| {name} | {', '.join(f'{v:.0f}' for v in values)} | {med:.0f} | {med / alone:.2f}x |")


if __name__ == "__main__":
    main()
