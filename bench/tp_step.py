"""A decode step's time with the model split over tensor-parallel ranks, beside one rank, in the
offline engine (issue 50: "measured step overhead vs TP=1 on CPU"). For each `--tp` size, in
turn per repeat: `batch` requests of `prompt` random tokens are prefilled, then the mean of
`steps` pure decode steps is taken. The engine gets `--threads` threads in all and its ranks
split them (rank 0 here, the others in processes the engine starts): TP=1 steps on 2 threads,
TP=2 on 1 a rank, the same cores. Also prints the step-input broadcasts a step took beyond the model's own
collectives (the all-reduces and the logits' gather), and the time of a KV handoff of
`--handoff-tokens` prompt tokens from that engine's cache to a one-rank receiver over ZeroMQ on
loopback (what `pdserve profile` times: every layer, the receiver's verdict; a TP=2 sender
interleaves its ranks' heads from the shared cache, workers/kv/shared_cache.py).

    python bench/tp_step.py [--model DIR] [--tp 1,2] [--threads 2] [--batch 8] [--prompt 256]
                            [--handoff-tokens 256,2048]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.cluster.planner.profile_transfer import kv_bytes_per_token, measure_transfer
from pdserve.workers.model.resolve import TINY
from pdserve.workers.transfer.base import Transport

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_name  # noqa: E402


def step_ms(llm: LLM, batch: int, prompt: int, steps: int, tag: str) -> float:
    engine, rng = llm.engine, random.Random(0)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [rng.randrange(5, vocab) for _ in range(prompt)],
                           SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True))
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()  # the prefills
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ms = (time.perf_counter() - start) / steps * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=TINY, help="model directory, or tiny (default)")
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated")
    p.add_argument("--threads", type=int, default=2, help="the engine's threads, split among its ranks")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--handoff-tokens", default="256,2048", help="KV handoff sizes, prompt tokens (comma-separated)")
    a = p.parse_args()
    handoffs = [int(x) for x in a.handoff_tokens.split(",")]
    sizes = [int(x) for x in a.tp.split(",")]
    threads = [max(1, a.threads // n) for n in sizes]  # a rank's share
    blocks = max(a.batch * (a.prompt + a.steps + 32) // 16 + 64, max(handoffs) // 16 + 16)
    results: dict[int, list[float]] = {n: [] for n in sizes}
    handoff_ms: dict[tuple[int, int], list[float]] = {(n, t): [] for n in sizes for t in handoffs}
    messages: dict[int, float] = {}
    for rep in range(a.repeats):
        for n, t in zip(sizes, threads):
            print(f"repeat {rep + 1}/{a.repeats}: TP={n} at {t} thread(s) a rank ...", file=sys.stderr, flush=True)
            torch.set_num_threads(a.threads)
            llm = LLM(a.model, dtype=a.dtype, max_num_seqs=a.batch, num_kv_blocks=blocks, tensor_parallel_size=n,
                      enforce_eager=True)
            try:
                results[n].append(step_ms(llm, a.batch, a.prompt, a.steps, f"r{rep}"))
                for point in measure_transfer(llm.engine, Transport.ZMQ, tuple(handoffs), 3, lambda msg: None):
                    handoff_ms[n, round(point.bytes / kv_bytes_per_token(llm.engine))].append(point.seconds * 1e3)
                group = llm.engine.tp_group
                if group is not None:
                    messages[n] = group.messages / group.steps
            finally:
                llm.close()
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; model {a.model}, {a.dtype}, eager; batch {a.batch}, "
          f"prompt {a.prompt}, {a.steps} decode steps, {a.repeats} repeats (sizes alternating)")
    base = statistics.median(results[sizes[0]])
    print("\n| TP | threads a rank | decode step ms (median) | runs | vs TP=" + str(sizes[0])
          + " | step-input broadcasts a step |")
    print("|---:|---:|---:|---|---:|---:|")
    for n, t in zip(sizes, threads):
        med = statistics.median(results[n])
        print(f"| {n} | {t} | {med:.2f} | {', '.join(f'{x:.2f}' for x in results[n])} | {med / base:.2f}x | "
              f"{messages.get(n, 0):.2f} |")
    print("\n| KV handoff, prompt tokens | " + " | ".join(f"TP={n} sender ms (median of repeats' medians)"
                                                         for n in sizes) + f" | vs TP={sizes[0]} |")
    print("|---:|" + "---:|" * (len(sizes) + 1))
    for t in handoffs:
        meds = [statistics.median(handoff_ms[n, t]) for n in sizes]
        print(f"| {t} | " + " | ".join(f"{m:.2f}" for m in meds) + f" | {meds[-1] / meds[0]:.2f}x |")


if __name__ == "__main__":
    main()
