"""The CPU decode attention op (pdserve/kernels/cpu_decode.py) on one layer's call, against the op as it was
at another git revision, alternating: time per call, the KV bytes it reads per second, and the
largest difference of their outputs (relative to the largest output).

Each shape gets 30 caches (a model's layers), called in turn, so a step's KV is not all in L2 as it
would be if one cache were called again and again.

    python bench/cpu_decode_op.py [--against HEAD~1] [--threads 1] [--dtype bfloat16|float32|float16]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.cpp_extension import load_inline

from pdserve.kernels import cpu_decode
from pdserve.kernels.cpp_build import InlineOp

# (query heads, KV heads, head dim, sequences, context): SmolLM2-135M at batch 8 and 1, the tiny
# model at batch 16, a Llama-3-8B layer at batch 8.
SHAPES = ((9, 3, 64, 8, 260), (9, 3, 64, 8, 1000), (9, 3, 64, 1, 300), (8, 2, 32, 16, 300), (32, 8, 128, 8, 500))
LAYERS = 30


def source_at(rev: str) -> str:
    for path in ("pdserve/kernels/cpu_decode.py", "kernels/cpu_decode.py"):  # before 2026-12-03: kernels/
        got = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
        if got.returncode == 0:
            text = got.stdout
            break
    else:
        raise SystemExit(f"no cpu_decode.py at {rev}")
    start = text.index('_SOURCE = r"""') + len('_SOURCE = r"""')
    return text[start:text.index('"""', start)]


Decode = Callable[..., torch.Tensor]


def build(source: str, tag: str) -> Decode:
    """The op of `source` as a function: a binding module's `decode` (revisions before the op was
    registered with the dispatcher), or the registered op under a name of its own (two revisions'
    `pdserve::cpu_decode` cannot both be registered in one process)."""
    print(f"building {tag} ...", flush=True)
    if "PYBIND11_MODULE" in source:
        name = f"pdserve_cpu_decode_bench_{tag}_" + hashlib.sha256(source.encode()).hexdigest()[:10]
        module = load_inline(name, cpp_sources=source, extra_cflags=cpu_decode._FLAGS)  # type: ignore[no-untyped-call]
        return module.decode  # type: ignore[no-any-return]
    op_name = f"cpu_decode_bench_{tag}"
    op = InlineOp(f"pdserve_{op_name}", source.replace('"cpu_decode', f'"{op_name}'), "PDSERVE_BENCH_OP",
                  f"{tag} decode op", op_name).load()
    assert op is not None, f"the {tag} op did not build (see the warning above)"
    return op


def layer(heads: int, kv_heads: int, dim: int, n: int, context: int, bs: int = 16,
          dtype: torch.dtype = torch.bfloat16) -> tuple[Any, ...]:
    per = (context + bs - 1) // bs
    blocks = 2 * n * per
    tables = torch.randperm(blocks)[: n * per].view(n, per).int()  # scattered over the pool
    kc = torch.randn(blocks, bs, kv_heads, dim).to(dtype)
    vc = torch.randn(blocks, bs, kv_heads, dim).to(dtype)
    q, k, v = (torch.randn(n, h, dim).to(dtype) for h in (heads, kv_heads, kv_heads))
    lens = torch.full((n,), context, dtype=torch.int32)
    slots = tables[:, (context - 1) // bs].long() * bs + (context - 1) % bs
    return q, k, v, kc, vc, slots, tables, lens, torch.arange(n + 1, dtype=torch.int32), dim ** -0.5


def time_calls(op: Decode, layers: list[tuple[Any, ...]], calls: int = 120) -> float:
    for args in layers[:10]:
        op(*args)
    start = time.perf_counter()
    for i in range(calls):
        op(*layers[i % len(layers)])
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", default="HEAD~1", help="git revision whose op to compare with")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    ops = {a.against: build(source_at(a.against), "old"), "this checkout": build(cpu_decode._SOURCE, "new")}
    dtype = getattr(torch, a.dtype)
    print(f"\n{a.dtype}, {a.threads} thread(s), {LAYERS} layers' caches per shape, medians of {a.rounds} "
          f"alternating rounds\n")
    print(f"| heads/KV/dim | seqs x context | {a.against} us | this checkout us | speed-up | GB/s (old/new) | "
          "max rel diff |")
    print("|---|---|---:|---:|---:|---|---:|")
    for heads, kvh, dim, n, context in SHAPES:
        torch.manual_seed(0)
        layers = [layer(heads, kvh, dim, n, context, dtype=dtype) for _ in range(LAYERS)]
        outs = [op(*layers[0]).float() for op in ops.values()]
        diff = ((outs[1] - outs[0]).abs().max() / outs[0].abs().max()).item()
        runs: dict[str, list[float]] = {k: [] for k in ops}
        for _ in range(a.rounds):
            for key, op in ops.items():
                runs[key].append(time_calls(op, layers))
        old, new = (statistics.median(r) for r in runs.values())
        kv = n * context * kvh * dim * 2 * dtype.itemsize  # K and V
        print(f"| {heads}/{kvh}/{dim} | {n} x {context} | {old:.0f} | {new:.0f} | {old / new:.2f}x | "
              f"{kv / old / 1e3:.1f} / {kv / new / 1e3:.1f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
