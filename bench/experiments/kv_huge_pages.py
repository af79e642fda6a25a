"""The CPU decode attention op (pdserve/kernels/cpu_decode.py) on a KV pool on transparent huge pages
(workers/kv/cache.py `cpu_zeros_on_huge_pages`) against the same pool on 4 KiB pages: both pools
in one process, the op called on every layer of each in turn, `--rounds` alternating rounds; time
per call (median) and the ratio. Each sequence's blocks are scattered over the whole pool, as a
served worker's are after a while.

    python bench/experiments/kv_huge_pages.py [--threads 2] [--rounds 9] [--pool-gib 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pdserve.kernels import cpu_decode
from pdserve.workers.kv.cache import cpu_zeros_on_huge_pages

# (query heads, KV heads, head dim, sequences, context, layers): the tiny model at batch 16,
# SmolLM2-135M at batch 8.
SHAPES = ((8, 2, 32, 16, 330, 4), (9, 3, 64, 8, 300, 30))
BLOCK = 16


def layers(shape: tuple[int, ...], pool_bytes: int,
           zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> list[tuple[Any, ...]]:
    """One decode call's arguments per layer, over a float32 pool of `pool_bytes` in all."""
    heads, kv_heads, dim, n, context, num_layers = shape
    blocks = pool_bytes // (num_layers * 2 * BLOCK * kv_heads * dim * 4)
    per = -(-context // BLOCK)
    full = zeros((num_layers, 2, blocks, BLOCK, kv_heads, dim), torch.float32).normal_()
    tables = torch.randperm(blocks)[: n * per].view(n, per).int()  # scattered over the pool
    q, k, v = (torch.randn(n, h, dim) for h in (heads, kv_heads, kv_heads))
    lens = torch.full((n,), context, dtype=torch.int32)
    slots = tables[:, (context - 1) // BLOCK].long() * BLOCK + (context - 1) % BLOCK
    starts = torch.arange(n + 1, dtype=torch.int32)
    return [(q, k, v, full[i, 0], full[i, 1], slots, tables, lens, starts, dim ** -0.5) for i in range(num_layers)]


def per_call_us(op: Any, args: list[tuple[Any, ...]], reps: int = 40) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        for a in args:
            op(*a)
    return (time.perf_counter() - t) / reps / len(args) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--pool-gib", type=float, default=4.0, help="each pool's size (the CPU default: 4)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    op = cpu_decode.load()
    if op is None:
        raise SystemExit("the CPU decode op did not build")
    print(f"| shape (heads, KV heads, head dim, sequences, context, layers), {a.pool_gib:g} GiB pool, "
          f"{a.threads} threads | 4 KiB pages us/call | huge pages us/call | ratio |")
    print("|---|---:|---:|---:|")
    for shape in SHAPES:
        pool = int(a.pool_gib * (1 << 30))
        small = layers(shape, pool, lambda s, d: torch.zeros(s, dtype=d))
        huge = layers(shape, pool, cpu_zeros_on_huge_pages)
        per_call_us(op, small, 3), per_call_us(op, huge, 3)
        s_us: list[float] = []
        h_us: list[float] = []
        for _ in range(a.rounds):
            s_us.append(per_call_us(op, small))
            h_us.append(per_call_us(op, huge))
        s_med, h_med = statistics.median(s_us), statistics.median(h_us)
        print(f"| {shape} | {s_med:.1f} | {h_med:.1f} | {h_med / s_med:.3f}x |", flush=True)
        del small, huge


if __name__ == "__main__":
    main()
