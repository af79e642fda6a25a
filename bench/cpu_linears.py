"""A model's linear layers on CPU, weight layouts side by side: plain [out, in], column-major
(what pdserve keeps for float32 weights it does not pack), oneDNN-packed (packed_linear.py), and in
float32 pdserve's own op on the column-major layout (pdserve/kernels/cpu_linear.py; up to 16 rows).

Every round times one pass over the model's linears per layout (`--layers` layers, each with weights
of its own so a pass streams them as a decode step does, and the lm_head once), interleaved, so the
machine's drift hits every layout alike; the table has the medians over rounds and the weight bytes
streamed per second.

    python bench/cpu_linears.py [--model DIR] [--dtype float32] [--rows 1 8 16] [--threads 1 2]
        [--layers N] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from pdserve.kernels import cpu_linear
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.default_model import default_model

Layout = Callable[[torch.Tensor], torch.Tensor]


def shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's fused linears and the lm_head."""
    return [(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size), (cfg.q_size, cfg.hidden_size),
            (cfg.hidden_size, 2 * cfg.intermediate_size), (cfg.intermediate_size, cfg.hidden_size),
            (cfg.hidden_size, cfg.vocab_size)]


def layouts(weights: list[torch.Tensor]) -> dict[str, list[Layout]]:
    col = [w.t().contiguous().t() for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    fns: dict[str, list[Layout]] = {
        "plain": [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights],
        "column-major": [lambda x, w=w: torch.nn.functional.linear(x, w) for w in col],
        "oneDNN packed": [lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                          for p in packed],
    }
    if weights[0].dtype is torch.float32 and cpu_linear.load() is not None:
        fns["pdserve op"] = [lambda x, w=w: cpu_linear.linear(x, w.t(), None) for w in col]
    return fns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: the default model)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--layers", type=int, help="layers of weights a pass streams (default: the model's)")
    args = p.parse_args()
    model_dir = args.model or str(default_model())
    cfg = ModelConfig.from_pretrained(model_dir)
    dtype = getattr(torch, args.dtype)
    dims = shapes(cfg)
    layers = args.layers or cfg.num_layers
    per_pass = [(k, n) for _ in range(layers) for k, n in dims[:-1]] + [dims[-1]]
    weights = [torch.randn(n, k).to(dtype) for k, n in per_pass]
    nbytes = sum(w.nbytes for w in weights)
    fns = layouts(weights)
    print(f"{model_dir}: {layers} x {dims[:-1]} and {dims[-1]} (in, out), {args.dtype}, {nbytes / 1e6:.1f} MB "
          f"per pass; medians of {args.rounds}")
    print("| threads | rows | " + " | ".join(f"{name} ms (GB/s)" for name in fns) + " | packed / plain |")
    print("|---:|---:|" + "---:|" * (len(fns) + 1))
    with torch.inference_mode():
        for threads in args.threads:  # noqa: B007 - the loop sets torch's threads
            torch.set_num_threads(threads)
            for rows in args.rows:
                xs = [torch.randn(rows, k).to(dtype) for k, _ in per_pass]
                samples: dict[str, list[float]] = {name: [] for name in fns}
                for _ in range(args.rounds):
                    for name, layer_fns in fns.items():
                        start = time.perf_counter()
                        for f, x in zip(layer_fns, xs, strict=True):
                            f(x)
                        samples[name].append(time.perf_counter() - start)
                med = {name: statistics.median(s) for name, s in samples.items()}
                cells = " | ".join(f"{m * 1e3:.2f} ({nbytes / m / 1e9:.1f})" for m in med.values())
                print(f"| {threads} | {rows} | {cells} | {med['oneDNN packed'] / med['plain']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
