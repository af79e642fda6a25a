"""A decode step's time in the offline engine: `batch` requests of `prompt` random tokens are
prefilled, then the engine steps them (pure decode steps) and the mean of `steps` steps is
taken, `--repeats` times; prints the median and the runs. For an A/B of two checkouts run it
once per checkout, alternating (docs/engine.md shows how).

    python bench/decode_step.py [--model DIR] [--threads 1] [--batch 8] [--prompt 256]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.workers.model.default_model import default_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: the default model)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model or str(default_model()), max_num_seqs=args.batch,
              num_kv_blocks=args.batch * (args.prompt + args.steps + 16) // 16 * 2 + 64)
    engine, rng = llm.engine, random.Random(0)
    vocab = engine.model_config.vocab_size
    runs = []
    for rep in range(args.repeats):
        for i in range(args.batch):
            engine.add_request(f"r{rep}-{i}", [rng.randrange(5, vocab) for _ in range(args.prompt)],
                               SamplingParams(max_tokens=args.steps + 4, temperature=0, ignore_eos=True))
        for _ in range(3):  # the prefill, and two steps for the batch to settle
            engine.step()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        runs.append((time.perf_counter() - start) / args.steps * 1e3)
        while engine.has_unfinished_requests():
            engine.step()
    print(f"{engine.dtype} threads={args.threads} batch={args.batch} context~{args.prompt}: decode ms/step "
          f"median {statistics.median(runs):.1f} (runs {', '.join(f'{r:.1f}' for r in runs)})")


if __name__ == "__main__":
    main()
