"""Decode step time with float32 linears packed from different weight sizes (packed_linear.FLOAT32_MIN_BYTES),
and the unpacked ones on pdserve's own op (pdserve/kernels/cpu_linear.py) or on MKL.

A variant is FLOOR (bytes; "auto": the shipped choice, packed_linear.float32_floor, which packs
nothing when the model's float32 linears fit in the last-level cache), optionally with ":mkl" (the
op off: PDSERVE_CPU_LINEAR_KERNEL=0 while that engine loads).
One engine per variant in one process, alternating A B A B over `--repeats` rounds; the time per
decode step is (t[prompt + 1 + K tokens] - t[prompt + 1 token]) / K, so prefill cancels out
(as bench/engine_vs_transformers.py measures it). Prompts are random token ids, fresh per call.
Medians and the ratio of each floor to the first.

    python bench/experiments/pack_floor.py [--model DIR] [--floors 1048576:mkl 1048576 auto] [--batches 1 16]
        [--context 300] [--steps 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from pdserve import LLM, SamplingParams
from pdserve.kernels import cpu_linear
from pdserve.workers.model import packed_linear


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    p.add_argument("--floors", nargs="+", default=["1048576:mkl", "1048576", "auto"],
                   help="variants: bytes or auto, with :mkl for the unpacked linears on MKL")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    per_seq = -(-(a.context + a.steps + 1) // 16)
    engines: dict[str, LLM] = {}
    auto = packed_linear.float32_floor
    for floor in a.floors:
        print(f"loading the engine with float32 linears packed from {floor} bytes ...", flush=True)
        size, _, kind = floor.partition(":")
        # both read when the model is laid out, at load
        packed_linear.float32_floor = auto if size == "auto" else (lambda model, n=int(size): n)  # type: ignore[misc]
        os.environ[cpu_linear.ENV] = "0" if kind == "mkl" else "1"
        engines[floor] = LLM(model=a.model, dtype="float32", progress=False, block_size=16,
                             max_num_seqs=max(a.batches), max_num_batched_tokens=2048,
                             num_kv_blocks=max(a.batches) * per_seq + 64)
    rng = random.Random(0)

    def generate(llm: LLM, batch: int, tokens: int) -> float:
        params = [SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True) for _ in range(batch)]
        prompts = [[rng.randrange(5, 4096) for _ in range(a.context)] for _ in range(batch)]
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    for llm in engines.values():  # warm-up: both graphs (many tokens, one token) at every batch
        for batch in a.batches:
            generate(llm, batch, 4)
    print("\n| batch | " + " | ".join(f"{f} ms/step" for f in a.floors) + " | "
          + " | ".join(f"{f} / {a.floors[0]}" for f in a.floors[1:]) + " |")
    print("|---:|" + "---:|" * (2 * len(a.floors) - 1))
    for batch in a.batches:
        runs: dict[str, list[float]] = {f: [] for f in a.floors}
        for rep in range(a.repeats):
            for floor, llm in engines.items():
                first = generate(llm, batch, 1)
                runs[floor].append(1000 * (generate(llm, batch, a.steps + 1) - first) / a.steps)
            print(f"  [batch {batch}] round {rep + 1}/{a.repeats}", flush=True)
        med = {f: statistics.median(r) for f, r in runs.items()}
        base = med[a.floors[0]]
        print(f"| {batch} | " + " | ".join(f"{med[f]:.3f}" for f in a.floors) + " | "
              + " | ".join(f"{med[f] / base:.2f}x" for f in a.floors[1:]) + " |", flush=True)


if __name__ == "__main__":
    main()
