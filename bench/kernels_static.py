"""What the attention kernels cost on an H100, read from a compile (no GPU needed).

Compiles paged decode (stage 1) and prefill for sm_90 with Triton's bundled
ptxas under every config of the tuning sweeps (pdserve/kernels/configs.py) and the
defaults, and prints per config: registers, spilled bytes, shared memory,
programs per SM and what bounds it, and how the KV loop's loads were lowered
(`cp.async`: pipelined copies; `ld.global`: synchronous loads; `wgmma`:
Hopper tensor-core dots). Static facts, not speed: they rule configs out
(spills, one program per SM, unpipelined loads), they do not rank the rest.

    python bench/kernels_static.py [--arch 90] [--head-dims 128,64] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from pdserve.kernels import configs, static_check

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _print_rows(title: str, rows: list[tuple[str, str]]) -> None:
    print(f"\n{title}")
    width = max(len(label) for label, _ in rows)
    for label, text in rows:
        print(f"  {label:<{width}}  {text}", flush=True)


def _report(fn, *args, **kwargs) -> str:
    try:
        return fn(*args, **kwargs).row()
    except Exception as e:  # noqa: BLE001 - a config that does not compile is a row, not a crash
        return f"does not compile: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, choices=(80, 90))
    ap.add_argument("--head-dims", default="128", help="comma list, e.g. 128,64")
    ap.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    ap.add_argument("--heads", default="32/8", help="query/KV heads (Llama-3-8B: 32/8)")
    ap.add_argument("--verify-rows", type=int, default=5, help="query rows per sequence of a speculative verify (k+1)")
    args = ap.parse_args(argv)
    if not static_check.available():
        print("this Triton has no bundled ptxas/cuobjdump: cannot compile for NVIDIA here", file=sys.stderr)
        return 2
    dtype = _DTYPES[args.dtype]
    heads, kv_heads = (int(x) for x in args.heads.split("/"))
    group = heads // kv_heads
    print(f"sm_{args.arch}, {args.dtype}, {heads} q / {kv_heads} KV heads, Triton "
          f"{__import__('triton').__version__}; compiling {len(configs.DECODE_SWEEP)} decode and "
          f"{len(configs.PREFILL_SWEEP)} prefill configs per head dim", flush=True)
    t0 = time.perf_counter()
    for head_dim in (int(x) for x in args.head_dims.split(",")):
        default = configs.decode_config(head_dim, dtype)
        for rows in (1, args.verify_rows):
            table = []
            for cfg in configs.DECODE_SWEEP:
                mark = " (default)" if cfg == default else ""
                table.append((cfg.label() + mark, _report(static_check.decode_report, cfg, head_dim=head_dim,
                                                          group=group, max_q=rows, dtype=dtype, arch=args.arch)))
            _print_rows(f"paged decode, head dim {head_dim}, {rows} query row(s) per sequence", table)
        pdefault = configs.prefill_config(triton_next_pow2(group), head_dim, 1 << 14, dtype, args.arch)
        table = []
        for cfg in configs.PREFILL_SWEEP:
            mark = " (default)" if cfg == pdefault else ""
            table.append((cfg.label() + mark, _report(static_check.prefill_report, cfg, head_dim=head_dim,
                                                      group=group, dtype=dtype, arch=args.arch)))
        _print_rows(f"prefill, head dim {head_dim}, long chunks", table)
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence 3.9's notice; the JIT default
    sys.exit(main())
