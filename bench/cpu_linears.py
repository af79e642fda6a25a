"""A model's linear layers on CPU, three weight layouts side by side: plain [out, in], column-major
(what pdserve keeps for float32) and oneDNN-packed (what it uses for bfloat16, packed_linear.py).

Every round times one pass over all the model's distinct linear shapes (one layer's and the
lm_head) per layout, interleaved, so the machine's drift hits every layout alike; the table has
the medians over rounds and the weight bytes streamed per second.

    python bench/cpu_linears.py [--model DIR] [--rows 1 8 16] [--threads 1 2] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

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
    return {
        "plain": [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights],
        "column-major": [lambda x, w=w: torch.nn.functional.linear(x, w) for w in col],
        "oneDNN packed": [lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                          for p in packed],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: the default model)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()
    model_dir = args.model or str(default_model())
    cfg = ModelConfig.from_pretrained(model_dir)
    dtype = getattr(torch, args.dtype)
    dims = shapes(cfg)
    weights = [torch.randn(n, k).to(dtype) for k, n in dims]
    nbytes = sum(w.nbytes for w in weights)
    fns = layouts(weights)
    print(f"{model_dir}: {dims} (in, out), {args.dtype}, {nbytes / 1e6:.1f} MB per pass; medians of {args.rounds}")
    print("| threads | rows | " + " | ".join(f"{name} ms (GB/s)" for name in fns) + " | packed / plain |")
    print("|---:|---:|" + "---:|" * (len(fns) + 1))
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                xs = [torch.randn(rows, k).to(dtype) for k, _ in dims]
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
