"""What the CPU dtype and the sampler's noise cost (docs/engine.md "dtype"; docs/performance.md
"The engine's CPU step").

Prints three tables: one linear layer in float32 and bfloat16 at SmolLM2's shapes; the
sampler's draw for 8 x 49,152 probabilities (the exponential race's Exp(1) noise by
`Tensor.exponential_` and by -log(U), against the CDF inversion it uses now); and
the offline engine (`LLM.generate`, random 256-token prompts, 64 out, EOS ignored, after a
warm-up on other prompts) per dtype and temperature, each run in a child process of its own.

    python bench/experiments/cpu_dtype.py --model <SmolLM2 dir> [--threads 2] [--batch 8] [--prompts 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

OFFLINE = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
from pdserve import LLM, SamplingParams
model, dtype, temp, batch, n = sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
llm = LLM(model, max_num_seqs=batch, progress=False, dtype=dtype)
g = torch.Generator().manual_seed(1)
vocab = llm.engine.model_config.vocab_size
sp = SamplingParams(temperature=temp, max_tokens=64, ignore_eos=True)
llm.generate([torch.randint(100, vocab, (256,), generator=g).tolist() for _ in range(2 * batch)], sp)
prompts = [torch.randint(100, vocab, (256,), generator=g).tolist() for _ in range(n)]
t = time.perf_counter(); llm.generate(prompts, sp); print(n * 64 / (time.perf_counter() - t))
"""


def median_us(fn: Callable[[], object], calls: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"# {a.threads} threads, torch {torch.__version__}\n\n| M x K x N | float32 us | bfloat16 us | ratio |")
    print("|---|---:|---:|---:|")
    for m, k, n in ((1, 576, 1536), (16, 576, 1536), (256, 576, 1536), (2048, 576, 1536)):
        t = {}
        for dt in (torch.float32, torch.bfloat16):
            x, w = torch.randn(m, k, dtype=dt), torch.randn(n, k, dtype=dt)
            t[dt] = median_us(lambda: torch.nn.functional.linear(x, w))
        print(f"| {m} x {k} x {n} | {t[torch.float32]:.0f} | {t[torch.bfloat16]:.0f} | "
              f"{t[torch.bfloat16] / t[torch.float32]:.2f} |")
    u = torch.empty(8, 49152)
    print("\n| Exp(1) noise, 8 x 49,152 | us |\n|---|---:|")
    print(f"| Tensor.exponential_ | {median_us(lambda: u.exponential_()):.0f} |")
    print(f"| -log(U), U from uniform_ | {median_us(lambda: u.uniform_().clamp_(min=1e-38).log_().neg_()):.0f} |")
    from pdserve.workers.sampler import categorical  # the sampler's draw now: one uniform a row

    probs = torch.randn(8, 49152).softmax(dim=-1)
    print(f"| no noise: the CDF inverted at one uniform a row (sampler.categorical) | "
          f"{median_us(lambda: categorical(probs, {})):.0f} |")
    print("\n| offline engine: dtype, temperature | output tok/s (runs) |\n|---|---|")
    for dtype, temp in (("float32", 0.0), ("bfloat16", 0.0), ("bfloat16", 1.0)):
        runs = []
        for _ in range(a.repeats):
            out = subprocess.run([sys.executable, "-c", OFFLINE, str(a.threads), a.model, dtype, str(temp),
                                  str(a.batch), str(a.prompts)], check=True, capture_output=True, text=True,
                                 timeout=1800)
            runs.append(float(out.stdout.split()[-1]))
        print(f"| {dtype}, {temp:g} | {', '.join(f'{r:.1f}' for r in runs)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
