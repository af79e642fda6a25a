"""A decode step's time in one engine at 1 and at 2 torch threads, alternating (the default
model, bfloat16 where the CPU has it, batch 8, ~256-token context). Dynamo specialises the
compiled graphs on the thread count: the first switch recompiles (its round shows seconds
per step); the medians are over 6 rounds. What lending a node's cores buys a decode step
(workers/cpu_lending.py; docs/serving-profile.md).

    python bench/step_threads.py 1      # graphs first compiled at 1 thread
"""
import random
import statistics
import sys
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.workers.model.default_model import default_model

compile_threads, batch, prompt, steps = int(sys.argv[1]), 8, 256, 20
torch.set_num_threads(compile_threads)
llm = LLM(str(default_model()), max_num_seqs=batch, num_kv_blocks=batch * (prompt + 200) // 16 * 2 + 64)
engine, rng = llm.engine, random.Random(0)
vocab = engine.model_config.vocab_size
res = {1: [], 2: []}
for rep in range(6):
    for i in range(batch):
        engine.add_request(f"r{rep}-{i}", [rng.randrange(5, vocab) for _ in range(prompt)],
                           SamplingParams(max_tokens=2 * steps + 8, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    for t in ((1, 2) if rep % 2 == 0 else (2, 1)):
        torch.set_num_threads(t)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        res[t].append((time.perf_counter() - start) / steps * 1e3)
    torch.set_num_threads(compile_threads)
    while engine.has_unfinished_requests():
        engine.step()
for t in (1, 2):
    print(f"compiled at {compile_threads}, stepping at {t}: median {statistics.median(res[t]):.1f} ms  "
          f"runs {[round(r, 1) for r in res[t]]}")
