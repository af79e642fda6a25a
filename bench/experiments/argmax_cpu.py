"""Greedy token choice on CPU: torch.argmax against the sampler's (numpy's) argmax over a step's
logits, float32, one thread, best of 5 repeats (workers/sampler.py `argmax`).

    python bench/experiments/argmax_cpu.py [--rows 10] [--vocab 4096 49152]
"""
import argparse
import platform
import timeit

import torch

from pdserve.workers.sampler import argmax

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--rows", type=int, default=10, help="rows of logits: the step's batch")
p.add_argument("--vocab", type=int, nargs="+", default=[4096, 49152], help="the tiny model's and SmolLM2's")
a = p.parse_args()
torch.set_num_threads(1)
with open("/proc/cpuinfo") as f:  # Linux; elsewhere platform's word for it
    cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
print(f"# argmax over {a.rows} rows of float32 logits, one thread; {cpu}")
print("| vocab | torch.argmax us | sampler.argmax us | ratio |\n|---:|---:|---:|---:|")
for vocab in a.vocab:
    logits = torch.randn(a.rows, vocab)
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))
    n = max(50, 2_000_000 // (a.rows * vocab))
    t_torch, t_ours = (min(timeit.repeat(f, number=n, repeat=5)) / n * 1e6
                       for f in (lambda: logits.argmax(dim=-1), lambda: argmax(logits)))
    print(f"| {vocab} | {t_torch:.1f} | {t_ours:.1f} | {t_torch / t_ours:.1f}x |")
