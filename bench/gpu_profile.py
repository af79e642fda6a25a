#!/usr/bin/env python3
"""Where a decode step's GPU time goes: the Llama-3-8B-shaped random-weight model of
bench/gpu_e2e.py, eager (kernel times are what a CUDA graph replays; eager only adds host
gaps), a few decode steps at each batch under torch.profiler, and per kernel family its
time per step and its share, beside the step's bytes/HBM floor.

    python3 bench/gpu_profile.py [--dry-run] [--batches 1,64] [--steps 8]

Why: at batch 1 a step reads ~16 GB of weights, so its floor is ~16 GB / HBM bandwidth;
the gap between the measured step and that floor is in these rows (GEMV efficiency of the
projections and lm_head, attention, norms and the sampler's own kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_e2e as e2e  # noqa: E402  (also puts the repo root on sys.path)

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.workers.stats import StepStats  # noqa: E402
from pdserve.workers.tiny.builder import default_model_dir  # noqa: E402

# Kernel name fragments -> the family a row is counted under (first match wins).
FAMILIES = [("gemv", "gemm/gemv"), ("gemm", "gemm/gemv"), ("cutlass", "gemm/gemv"), ("nvjet", "gemm/gemv"),
            ("sm90", "gemm/gemv"), ("_decode_stage", "attention (triton decode)"),
            ("_prefill", "attention (triton prefill)"), ("rms", "rms_norm"), ("rope", "rope"),
            ("write_kv", "write_kv"), ("silu", "silu*mul"), ("act_and_mul", "silu*mul"),
            ("argmax", "sampler"), ("max", "sampler"), ("softmax", "sampler")]


def family(name: str) -> str:
    low = name.lower()
    return next((fam for frag, fam in FAMILIES if frag in low), "other")


def profile_batch(llm: LLM, batch: int, prompt: int, steps: int) -> dict[str, Any]:
    """Prefill `batch` prompts, then profile `steps` pure decode steps of the whole batch."""
    eng = llm.engine
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(10, eng.model_config.vocab_size, (prompt,), generator=g).tolist() for _ in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 80, ignore_eos=True, detokenize=False)
    decode_steps: list[StepStats] = []
    prof: Any = None
    started = False

    def observe(s: StepStats) -> None:  # after each step: start profiling once the batch only decodes
        nonlocal prof, started
        if s.prefill_tokens == 0 and s.decode_seqs == batch:
            if not started:
                started = True
                e2e.sync(eng.device)
                prof = profile(activities=[ProfilerActivity.CUDA] if eng.device.type == "cuda"
                               else [ProfilerActivity.CPU])
                prof.__enter__()
            elif len(decode_steps) < steps:
                decode_steps.append(s)
                if len(decode_steps) == steps:
                    e2e.sync(eng.device)
                    prof.__exit__(None, None, None)

    eng.step_observers.append(observe)
    try:
        llm.generate(prompts, sp)
    finally:
        eng.step_observers.remove(observe)
        if prof is not None and len(decode_steps) < steps:  # never stopped: stop it before raising
            prof.__exit__(None, None, None)
    if prof is None or len(decode_steps) < steps:
        raise RuntimeError(f"batch {batch}: only {len(decode_steps)} whole-batch decode steps were seen")
    by_family: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        # self time: a CPU op's device time is its kernels', which are rows of their own
        own = ev.self_device_time_total if eng.device.type == "cuda" else ev.self_cpu_time_total
        us = own / steps
        if us <= 0:
            continue
        by_family[family(ev.key)] += us
        by_kernel[ev.key[:70]] += us
    total = sum(by_family.values())
    need = e2e.bytes_per_step(llm, batch, prompt + steps / 2)
    return {"batch": batch, "prompt": prompt, "steps": steps, "kernel_us_per_step": total,
            "bytes_per_step_gb": need / 1e9, "families": dict(by_family),
            "top_kernels": dict(sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12])}


def report(r: dict[str, Any], bw: float) -> str:
    floor_us = r["bytes_per_step_gb"] * 1e9 / bw * 1e6
    lines = [f"batch {r['batch']}, prompt {r['prompt']}: kernels {r['kernel_us_per_step']:.0f} us/step; "
             f"bytes floor {floor_us:.0f} us ({r['bytes_per_step_gb']:.2f} GB at {bw / 1e12:.2f} TB/s) -> "
             f"{100 * floor_us / r['kernel_us_per_step']:.0f}% of the bytes limit's speed",
             "| family | us/step | share |", "|---|---:|---:|"]
    for fam, us in sorted(r["families"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {fam} | {us:.1f} | {100 * us / r['kernel_us_per_step']:.1f}% |")
    lines += ["", "| kernel | us/step |", "|---|---:|"]
    lines += [f"| `{k}` | {us:.1f} |" for k, us in r["top_kernels"].items()]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, the two-layer float32 model: the script's logic")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    prompt = 24 if args.dry_run else args.prompt
    shape = e2e.DRY_LLAMA if args.dry_run else e2e.LLAMA3_8B
    model_dir = e2e.shape_dir(shape)
    bw = e2e.copy_bandwidth(device, args.dry_run)
    with e2e.random_weights():
        llm = LLM(str(model_dir), tokenizer=str(default_model_dir(progress=False)), dtype=shape["torch_dtype"],
                  device=device.type, max_model_len=prompt + args.steps + 128, max_num_seqs=max(batches),
                  enable_prefix_caching=False, enforce_eager=True, progress=False)
    results = []
    for b in batches:
        r = profile_batch(llm, b, prompt, args.steps)
        results.append(r)
        print(report(r, bw), "\n", flush=True)
    out = os.environ.get("OUT")
    if out:
        (Path(out) / "gpu_profile.json").write_text(json.dumps({"device": str(device), "bandwidth": bw,
                                                                "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
