"""A decode step's time in one engine at 1 and at 2 torch threads, alternating (bfloat16 where
the CPU has it, ~256-token context). Dynamo specialises the compiled graphs on the thread
count: the first switch recompiles (its round shows seconds per step); the medians are over
the rounds. What lending a node's cores buys a decode step, by the size of the model's
weights (workers/cpu_lending.py, `--cpu-sharing auto`; docs/performance.md
"Cores, threads and priorities on a small node").

    python bench/step_threads.py [--model DIR] [--batch 8] [--compile-threads 1] [--rounds 6]
"""
import argparse
import random
import statistics
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.workers.model.default_model import default_model
from pdserve.workers.model.packed_linear import num_parameters

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", default=None, help="model directory (default: the default model)")
p.add_argument("--batch", type=int, default=8)
p.add_argument("--prompt", type=int, default=256)
p.add_argument("--steps", type=int, default=20, help="steps timed per round and thread count")
p.add_argument("--rounds", type=int, default=6)
p.add_argument("--compile-threads", type=int, default=1, help="thread count the graphs are first compiled at")
a = p.parse_args()

torch.set_num_threads(a.compile_threads)
llm = LLM(a.model or str(default_model()), max_num_seqs=a.batch,
          num_kv_blocks=a.batch * (a.prompt + 2 * a.steps + 16) // 16 * 2 + 64)
engine, rng = llm.engine, random.Random(0)
vocab = engine.model_config.vocab_size
weights = num_parameters(engine.model) * engine.dtype.itemsize
res: dict[int, list[float]] = {1: [], 2: []}
for rep in range(a.rounds):
    print(f"[step_threads] round {rep + 1}/{a.rounds}", flush=True)
    for i in range(a.batch):
        engine.add_request(f"r{rep}-{i}", [rng.randrange(5, vocab) for _ in range(a.prompt)],
                           SamplingParams(max_tokens=2 * a.steps + 8, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    for t in ((1, 2) if rep % 2 == 0 else (2, 1)):
        torch.set_num_threads(t)
        start = time.perf_counter()
        for _ in range(a.steps):
            engine.step()
        res[t].append((time.perf_counter() - start) / a.steps * 1e3)
    torch.set_num_threads(a.compile_threads)
    while engine.has_unfinished_requests():
        engine.step()
one, two = statistics.median(res[1]), statistics.median(res[2])
print(f"model {a.model or 'default'}: weights {weights / 2**20:.1f} MiB ({engine.dtype}), batch {a.batch}")
for t in (1, 2):
    print(f"compiled at {a.compile_threads}, stepping at {t}: median {statistics.median(res[t]):.1f} ms  "
          f"runs {[round(r, 1) for r in res[t]]}")
print(f"2 threads / 1 thread: {two / one:.2f}x the step time")
