#!/usr/bin/env python3
"""pdserve end to end on one GPU: decode speed against the bytes/HBM limit, with and
without CUDA graphs, and chunked prefill against one pass. Part of bench/gpu_check.sh.

1. copy bandwidth (a 1 GiB device-to-device copy, bytes read + written): the HBM ceiling;
2. the tiny model (bf16): its step time is the host's per-step cost, what CUDA graphs cut;
3. a Llama-3-8B-shaped model (32 layers, 4096 hidden, 32 q / 8 KV heads, vocab 128256)
   with random bf16 weights made on the device (nothing to download), greedy decode at
   batch 1/8/32/64, eager, with CUDA graphs and synchronous scheduling, and with CUDA graphs
   and async scheduling (the default: the next step queued before this one's tokens are
   read, docs/engine.md), against the limit
       B / ((weight bytes a step reads + K/V bytes of the batch) / HBM bandwidth);
4. a long prompt prefilled in chunks, in chunks with the device synchronised after every
   step, and in one pass: the first two must agree bit for bit (a host staging buffer
   reused before its copy ran shows here), the last within bf16 noise.

    python3 bench/gpu_e2e.py [--dry-run] [--only tiny,llama] [--batches 1,8,32,64]

--dry-run: the CPU, float32, a two-layer model of the same kind and short prompts: checks
this script's own logic (CI runs it), says nothing about speed. Writes $OUT/e2e.json
when OUT is set; exits 1 when a check fails or a section raised.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the lent GPU machine has pdserve's tree, not the package

import pdserve.workers.engine as engine_mod  # noqa: E402
from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.workers.model import fp8  # noqa: E402
from pdserve.workers.model.llama import LlamaForCausalLM  # noqa: E402
from pdserve.workers.scheduler import SchedulerConfig  # noqa: E402
from pdserve.workers.stats import StepStats  # noqa: E402
from pdserve.workers.tiny.builder import default_model_dir  # noqa: E402

PEAK_HBM = {"H100": 3.35e12, "H200": 4.8e12}  # SXM datasheets, bytes/s
LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_hidden_layers": 32, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": 128001,
}
# --dry-run: the same kind of model, small enough for a CPU in seconds.
DRY_LLAMA = LLAMA3_8B | {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512,
                         "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2,
                         "torch_dtype": "float32"}

RESULTS: dict[str, Any] = {"checks": [], "errors": [], "tiny": [], "llama": []}


def log(msg: str) -> None:
    print(msg, flush=True)


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS["checks"].append({"check": name, "ok": bool(ok), "detail": detail})
    log(f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, dry: bool) -> float:
    """Bytes read + written per second by a device-to-device copy: the memory ceiling."""
    n = (1 << 24) if dry else (1 << 29)  # 32 MiB / 1 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(5 if dry else 23):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n * 2 / statistics.median(times[2:])


def random_load(model_dir: object, cfg: Any, dtype: torch.dtype, device: torch.device, backend: Any,
                max_positions: int, *_: object, quantization: str | None = None, **__: object) -> LlamaForCausalLM:
    """Stands in for the loader: the same module tree, N(0, 0.02) weights made on the device in
    `dtype` (the decoder's linears then quantized to e4m3 with `quantization="fp8"`, as the loader does)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, backend, max_positions)
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.model.rotary.build(device, dtype)
    if quantization == "fp8":
        fp8.quantize_linears(model)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return model.eval()


@contextmanager
def random_weights() -> Iterator[list[int]]:
    """Engines built inside load random weights; yields a list that counts the loads (a
    check that the engine still loads through this name)."""
    calls: list[int] = []
    original = engine_mod.load_model

    def load(*args: Any, **kwargs: Any) -> LlamaForCausalLM:
        calls.append(1)
        return random_load(*args, **kwargs)

    engine_mod.load_model = load  # type: ignore[assignment]
    try:
        yield calls
    finally:
        engine_mod.load_model = original  # type: ignore[assignment]


def bytes_per_step(llm: LLM, batch: int, avg_ctx: float) -> float:
    """Weights a decode step reads (the embedding table only for B rows: left out, unless tied
    to lm_head) + K/V of every sequence."""
    eng = llm.engine
    cfg = eng.model_config
    weights = sum(p.numel() * p.element_size() for n, p in eng.model.named_parameters()
                  if "embed_tokens" not in n or cfg.tie_word_embeddings)
    esize = torch.empty(0, dtype=eng.dtype).element_size()
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * esize
    return weights + batch * avg_ctx * kv_per_token


def decode_run(llm: LLM, batch: int, prompt_len: int, new_tokens: int, seed: int) -> dict[str, Any]:
    """Greedy decode of `batch` random prompts; the step time is the median interval between
    consecutive pure-decode steps of the whole batch (scheduler, sampler and outputs included)."""
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    stamps: list[tuple[float, StepStats]] = []

    def observe(s: StepStats) -> None:  # engine thread, after every step that ran the model
        stamps.append((time.perf_counter(), s))

    eng.step_observers.append(observe)
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    sync(eng.device)
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, sp)
    finally:
        eng.step_observers.remove(observe)
    wall = time.perf_counter() - t0
    if not all(len(o.outputs[0].token_ids) == new_tokens for o in outs):
        raise RuntimeError(f"batch {batch}: outputs shorter than {new_tokens} tokens")
    decode = [i for i, (_, s) in enumerate(stamps) if s.prefill_tokens == 0 and s.decode_seqs == batch]
    follows = set(decode)
    gaps = [stamps[i][0] - stamps[i - 1][0] for i in decode if i - 1 in follows]
    step = statistics.median(gaps) if gaps else float("nan")
    inside = statistics.median(stamps[i][1].duration_s for i in decode) if decode else float("nan")
    return {"batch": batch, "prompt": prompt_len, "new": new_tokens, "decode_steps": len(decode),
            "step_ms": step * 1e3, "in_step_ms": inside * 1e3, "tok_s": batch / step, "wall_s": wall,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def measure(llm: LLM, label: str, batches: list[int], prompt_len: int, new_tokens: int,
            bws: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    for b in batches:
        decode_run(llm, b, 16, 3, seed=1000 + b)  # warm: anything this batch size compiles lazily
        r = decode_run(llm, b, prompt_len, new_tokens, seed=b)
        need = bytes_per_step(llm, b, prompt_len + new_tokens / 2)
        r |= {"label": label, "bytes_per_step_gb": need / 1e9}
        for name, bw in bws.items():
            r[f"limit_tok_s_{name}"] = b / (need / bw)
            r[f"pct_of_limit_{name}"] = 100 * r["tok_s"] / r[f"limit_tok_s_{name}"]
        rows.append(r)
        lim = "  ".join(f"{r[f'pct_of_limit_{k}']:5.1f}% of the {k} limit ({r[f'limit_tok_s_{k}']:.0f})" for k in bws)
        log(f"  {label:<16} B={b:<3} step {r['step_ms']:7.2f} ms (inside engine.step {r['in_step_ms']:6.2f})"
            f"  {r['tok_s']:9.0f} tok/s  {lim}")
    return rows


def graph_state(llm: LLM) -> str:
    """What the runner says of its CUDA graphs (captured buckets, replays), if it has any."""
    graphs = getattr(llm.engine.runner, "graphs", None)
    describe = getattr(graphs, "describe", None)
    return str(describe()) if callable(describe) else ("none" if graphs is None else repr(graphs))


@contextmanager
def captured_logits(llm: LLM, keep: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Every `compute_logits` result while inside, as `keep` (a float copy) stores it."""
    eng = llm.engine
    captured: list[torch.Tensor] = []
    original = eng.model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        captured.append(keep(logits.float()))
        return logits

    eng.model.compute_logits = capture  # type: ignore[method-assign]
    try:
        yield captured
    finally:
        eng.model.compute_logits = original  # type: ignore[method-assign]


def chunked_parity(llm: LLM, prompt_len: int, chunk: int) -> dict[str, Any]:
    """One long prompt, prefix caching off: in `chunk`-token steps, the same with the device
    synchronised after every step (no copy can still be queued when the next step writes the
    staging buffers), and in one step. Compares the last position's logits."""
    eng = llm.engine

    def synced(_: StepStats) -> None:
        sync(eng.device)

    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(10, eng.model_config.vocab_size, (prompt_len,), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    base = eng.scheduler.config

    def run(budget: int, synchronise: bool) -> tuple[torch.Tensor, float]:
        eng.scheduler.config = SchedulerConfig(base.max_num_seqs, budget)
        captured.clear()
        if synchronise:
            eng.step_observers.append(synced)
        try:
            sync(eng.device)
            t0 = time.perf_counter()
            llm.generate([prompt], sp)
            sync(eng.device)
            return captured[-1][-1], time.perf_counter() - t0
        finally:
            if synchronise:
                eng.step_observers.remove(synced)

    try:
        with captured_logits(llm, torch.Tensor.clone) as captured:  # run() reads it
            one, t_one = run(prompt_len, False)
            chunked, t_chunked = run(chunk, False)
            safe, _ = run(chunk, True)
    finally:
        eng.scheduler.config = base

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    cfg = eng.model_config
    linear = sum(p.numel() for n, p in eng.model.named_parameters() if "embed_tokens" not in n)
    flops = 2 * linear * prompt_len + 2 * prompt_len**2 * cfg.num_heads * cfg.head_dim * cfg.num_layers
    out = {"prompt": prompt_len, "chunk": chunk, "chunked_equals_synced": bool(torch.equal(chunked, safe)),
           "rel_chunked_vs_synced": rel(chunked, safe), "rel_chunked_vs_one_step": rel(safe, one),
           "one_step_s": t_one, "one_step_tflops": flops / t_one / 1e12, "chunked_s": t_chunked}
    check("chunked prefill = chunked with a sync after every step (bitwise)", out["chunked_equals_synced"],
          f"rel {out['rel_chunked_vs_synced']:.2e} over {prompt_len} tokens in {chunk}-token chunks")
    tol = 1e-4 if eng.dtype == torch.float32 else 5e-2
    check("chunked prefill ~ one pass", out["rel_chunked_vs_one_step"] < tol,
          f"rel {out['rel_chunked_vs_one_step']:.2e} (tolerance {tol:g}: {eng.dtype} tiling noise)")
    log(f"  one {prompt_len}-token step {t_one * 1e3:.0f} ms = {out['one_step_tflops']:.1f} TFLOP/s")
    return out


def logit_trace(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    """Greedy decode of `batch` random prompts (unmeasured), keeping every step's logits on the
    host: what `compare_traces` lines up between two engines over the same weights."""
    eng = llm.engine
    g = torch.Generator().manual_seed(4242)
    prompts = [torch.randint(10, eng.model_config.vocab_size, (n,), generator=g).tolist()
               for n in range(prompt_len, prompt_len + 7 * batch, 7)]
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    with captured_logits(llm, torch.Tensor.cpu) as captured:
        outs = llm.generate(prompts, sp)
    return {"logits": captured, "tokens": [o.outputs[0].token_ids for o in outs]}


def compare_traces(a: dict[str, Any], b: dict[str, Any], tol: float) -> tuple[bool, str]:
    """Two greedy runs of one model that may differ only by float rounding (CUDA graphs plan the
    decode split from the bucket, eager from the real lengths: another summation order). Same
    schedule, so step i of one is step i of the other while their tokens agree. Holds when every
    step up to the first token that differs has logits within `tol` (relative), and that first
    differing token is a near tie: eager's top two logits there are closer than twice the
    largest logit difference of that row. A wrong graph (stale inputs, a bad pad) fails both."""
    worst, first_diff = 0.0, None
    for step, (x, y) in enumerate(zip(a["logits"], b["logits"])):
        if x.shape != y.shape:
            return False, f"step {step}: logits {tuple(x.shape)} vs {tuple(y.shape)} (the schedules differ)"
        rel = float((x - y).norm() / x.norm())
        worst = max(worst, rel)
        differs = (x.argmax(-1) != y.argmax(-1)).nonzero().flatten().tolist()
        if rel > tol:
            return False, f"step {step}: logits rel {rel:.2e} > {tol:g}"
        if differs:
            row = differs[0]
            top2 = x[row].topk(2).values
            gap, dmax = float(top2[0] - top2[1]), float((x[row] - y[row]).abs().max())
            first_diff = (f"first token difference at step {step} (row {row}): a near tie, "
                          f"top-2 gap {gap:.3g} vs max |diff| {dmax:.3g}")
            if gap > 2 * dmax:
                return False, (f"step {step} row {row}: tokens differ though the top-2 gap {gap:.3g} "
                               f"> 2 x max |diff| {dmax:.3g}")
            break  # after a different token the two runs follow other sequences
    same = sum(ta == tb for ta, tb in zip(a["tokens"], b["tokens"]))
    detail = f"logits rel <= {worst:.1e} (tol {tol:g}); {same}/{len(a['tokens'])} sequences token-identical"
    return True, detail + (f"; {first_diff}" if first_diff else "")


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def save() -> None:
    """$OUT/e2e.json as it stands: written after every section, so a run stopped by its
    timeout still leaves what it measured."""
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        rows = {k: [{f: v for f, v in r.items() if f != "tokens"} for r in RESULTS[k]] for k in ("tiny", "llama")}
        (Path(out) / "e2e.json").write_text(json.dumps(RESULTS | rows, indent=1, default=str))


def section(name: str, fn: Callable[[], None]) -> None:
    log(f"== {name}")
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - one section's failure must not hide the others' results
        traceback.print_exc()
        RESULTS["errors"].append(f"{name}: {type(e).__name__}: {e}")
    save()


def tiny_section(args: argparse.Namespace, device: torch.device, bws: dict[str, float]) -> None:
    """The tiny model's step is nearly all host time: what CUDA graphs remove."""
    dtype = "float32" if args.dry_run else "bfloat16"
    traces: dict[str, dict[str, Any]] = {}
    # every sequence of the largest batch resident at once (else no step decodes the whole batch)
    blocks = 2 * max(args.batches) * -(-(args.prompt + args.new) // 16) + 64
    for eager in (True,) if device.type != "cuda" else (True, False):
        llm = LLM(dtype=dtype, device=device.type, num_kv_blocks=blocks, enforce_eager=eager, progress=False)
        label = "tiny eager" if eager else "tiny graphs"
        log(f"  {label}: backend {llm.engine.model.model.layers[0].self_attn.backend.value}, "
            f"{llm.engine.dtype}, graphs: {graph_state(llm)}")
        RESULTS["tiny"] += measure(llm, label, args.batches, args.prompt, args.new, bws)
        traces[label] = logit_trace(llm, 8 if not args.dry_run else 2, args.prompt, args.new)
        if args.dry_run:  # no graphs on a CPU: a second eager run is what the comparison meets
            traces[label + " again"] = logit_trace(llm, 2, args.prompt, args.new)
        del llm
        free(device)
    compare_variants("tiny", traces, args.dry_run)


def shape_dir(shape: dict[str, Any]) -> Path:
    """A model directory that holds only `shape` as its config.json (random_weights() draws the
    weights at load), removed when this process exits (each run used to leave one in /tmp)."""
    model_dir = Path(tempfile.mkdtemp(prefix="llama-shape-"))
    atexit.register(shutil.rmtree, model_dir, True)
    (model_dir / "config.json").write_text(json.dumps(shape))
    return model_dir


def llama_section(args: argparse.Namespace, device: torch.device, bws: dict[str, float]) -> None:
    shape = DRY_LLAMA if args.dry_run else LLAMA3_8B
    model_dir = shape_dir(shape)
    tokenizer = str(default_model_dir(progress=False))
    by_variant: dict[str, list[dict[str, Any]]] = {}
    traces: dict[str, dict[str, Any]] = {}
    # (label, eager, async scheduling): the dry run has no graphs, and checks async against sync eagerly.
    # fp8: the same random weights quantized at load (e4m3, per-channel scales; docs/engine.md).
    variants = ([("eager", True, False, None), ("eager async", True, True, None), ("eager fp8", True, False, "fp8")]
                if device.type != "cuda" else
                [("eager", True, True, None), ("cuda graphs sync", False, False, None),
                 ("cuda graphs", False, True, None), ("cuda graphs fp8", False, True, "fp8")])
    for label, eager, overlap, quantization in variants:
        with random_weights() as loads:
            t0 = time.perf_counter()
            llm = LLM(str(model_dir), tokenizer=tokenizer, dtype=shape["torch_dtype"], device=device.type,
                      max_model_len=args.parity_prompt + 64, max_num_seqs=max(args.batches),
                      max_num_batched_tokens=args.parity_prompt, enable_prefix_caching=False,
                      enforce_eager=eager, async_scheduling=overlap, quantization=quantization, progress=False)
        if not loads:
            raise RuntimeError("the engine no longer loads through engine.load_model: update random_weights()")
        eng = llm.engine
        eng.scheduler.config = SchedulerConfig(eng.scheduler.config.max_num_seqs, args.chunk)
        mem = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        log(f"  {label}: engine up in {time.perf_counter() - t0:.1f} s; "
            f"{sum(p.numel() for p in eng.model.parameters()) / 1e6:.1f} M params; {eng.num_kv_blocks} KV blocks; "
            f"{mem:.1f} GiB allocated; graphs: {graph_state(llm)}")
        by_variant[label] = measure(llm, f"llama {label}", args.batches, args.prompt, args.new, bws)
        RESULTS["llama"] += by_variant[label]
        traces[label] = logit_trace(llm, 8 if not args.dry_run else 2, args.prompt, args.new)
        if label == "eager":
            RESULTS["chunked_prefill"] = chunked_parity(llm, args.parity_prompt, args.chunk)
        del llm, eng
        free(device)
    compare_variants("llama", traces, args.dry_run)
    plain, quant = by_variant.get("cuda graphs", by_variant.get("eager")), by_variant.get(
        "cuda graphs fp8", by_variant.get("eager fp8"))
    if plain and quant:  # issue 49's bar: fp8 weights >= 1.6x the bf16 tok/s at batch 1
        RESULTS["fp8_speedup"] = [{"batch": a["batch"], "bf16_tok_s": a["tok_s"], "fp8_tok_s": b["tok_s"],
                                   "ratio": b["tok_s"] / a["tok_s"]} for a, b in zip(plain, quant)]
        for r in RESULTS["fp8_speedup"]:
            log(f"  fp8 against bf16, batch {r['batch']}: {r['ratio']:.2f}x")
    base = by_variant["eager"]
    for label, rows in by_variant.items():  # information: the timed runs' tokens (bf16 near ties may flip them)
        for a, b in zip(base, rows) if label != "eager" else ():
            same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
            log(f"  timed runs, batch {a['batch']}, {label} against eager: {same}/{len(a['tokens'])} sequences "
                "token-identical")


def compare_variants(model: str, traces: dict[str, dict[str, Any]], dry_run: bool) -> None:
    """Every variant against the first (eager) over the same weights (`compare_traces`). In a
    dry run (no graphs on a CPU) eager runs, which must agree to float32 rounding, so the
    comparison runs in CI on traces of its own."""
    labels = list(traces)  # the reference first: its top two judge ties
    for label in labels[1:]:
        if "fp8" in label:  # e4m3 weights and activations: ~0.1 relative on the tiny model (tests/workers/test_fp8.py)
            ok, detail = compare_traces(traces[labels[0]], traces[label], 0.3)
            check(f"{model}: greedy decode, {label} = {labels[0]} within fp8 noise", ok, detail)
            continue
        if dry_run:
            ok, detail = compare_traces(traces[labels[0]], traces[label], 1e-5)
            check(f"{model}: {label} = {labels[0]} (dry run: float32 rounding)", ok, detail)
            continue
        # 0.25: rounding through 32 random bf16 layers moved the logits up to 4.8e-2 (H200, 512-token
        # prompts, tokens still identical); a graph fed stale or misplaced inputs gives ~1.4.
        ok, detail = compare_traces(traces[labels[0]], traces[label], 0.25)
        check(f"{model}: greedy decode, {label} = {labels[0]} up to rounding", ok, detail)


def table() -> str:
    lines = ["| model | B | step ms | tok/s | % of limit (copy BW) | % of limit (datasheet) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in RESULTS["tiny"] + RESULTS["llama"]:
        peak = r.get("pct_of_limit_peak")
        lines.append(f"| {r['label']} | {r['batch']} | {r['step_ms']:.2f} | {r['tok_s']:.0f} | "
                     f"{r['pct_of_limit_copy']:.1f} | {'' if peak is None else f'{peak:.1f}'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, float32, a two-layer model, short prompts")
    ap.add_argument("--only", default="tiny,llama", help="sections: tiny, llama")
    ap.add_argument("--batches", default="", help="decode batch sizes (default 1,8,32,64; dry run 1,2)")
    args = ap.parse_args()
    args.batches = [int(b) for b in (args.batches or ("1,2" if args.dry_run else "1,8,32,64")).split(",")]
    # prompt / new tokens per decode run; the long prompt of the chunked check and its chunk
    args.prompt, args.new, args.parity_prompt, args.chunk = (24, 6, 200, 64) if args.dry_run else (512, 64, 6144, 2048)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if device.type != "cuda" and not args.dry_run:
        print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)"
    bws = {"copy": copy_bandwidth(device, args.dry_run)}
    for key, peak in PEAK_HBM.items():
        if key in name:
            bws["peak"] = peak
    RESULTS.update(device=name, torch=torch.__version__, bandwidth=bws, dry_run=args.dry_run)
    log(f"device {name}; torch {torch.__version__}; copy bandwidth {bws['copy'] / 1e12:.3f} TB/s (read + write)")
    only = set(args.only.split(","))
    t0 = time.perf_counter()
    if "tiny" in only:
        section("tiny model: the per-step host cost", lambda: tiny_section(args, device, bws))
    if "llama" in only:
        section("Llama-3-8B-shaped model, random weights" + (" (dry run: 2 layers)" if args.dry_run else ""),
                lambda: llama_section(args, device, bws))
    RESULTS["wall_s"] = time.perf_counter() - t0
    for rows in (RESULTS["tiny"], RESULTS["llama"]):
        for r in rows:
            r.pop("tokens", None)
    log("\n" + table())
    failed = [c["check"] for c in RESULTS["checks"] if not c["ok"]]
    log(f"\nchecks {len(RESULTS['checks']) - len(failed)}/{len(RESULTS['checks'])} PASS; "
        f"errors {len(RESULTS['errors'])}; {RESULTS['wall_s']:.0f} s")
    save()
    return 1 if failed or RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
