"""GPU check of pdserve's Triton kernels: correctness (bf16 vs float64), then timing.

One script for a lent H100/H200 (only torch + triton there, no Ray, pdserve not
installed: the package folders are mapped by hand). In a few minutes it

1. prints the device, torch/triton/CUDA versions and the exact command;
2. measures the card's ceilings: a 2 GiB device-to-device `copy_` (bytes read +
   written) and a bf16 8192^3 matmul, medians of `triton.testing.do_bench`;
3. per kernel, checks correctness first (bf16 on fresh random inputs against a
   float64 reference, outputs poisoned with NaN first; max abs and
   ||out - ref|| / ||ref||, PASS at <= 1e-2 and no NaN), then times it:
   - paged decode (Llama-3-8B heads: 32 q / 8 KV, head dim 128, block 16),
     batch 1/8/64 x context 1k/4k/16k; bytes = K+V read + q/out; GB/s and % of
     the copy bandwidth; bar: >= 80% at batch 64 x 4k;
   - prefill (causal, K/V already in the paged cache, shuffled block ids),
     1k..16k tokens as one sequence and 4 x 4k; TFLOP/s (2 S^2 H D per sequence)
     against SDPA's flash backend (GQA) on the same shapes, A B A B; bar:
     >= 0.9x SDPA at >= 4k tokens;
   - write_kv, fused add + RMSNorm and RoPE (8192 x 4096 / 8192 tokens x 40
     heads): GB/s vs the copy bandwidth, and the eager torch path for scale;
4. prints the summary table LAST and writes it as JSON (and text) under $OUT.

do_bench flushes L2 before every timed call and times with device events; the
flush also keeps the GPU busy while the next launch is queued, so small
kernels are timed without host launch gaps.

    python3 bench/kernels_gpu.py [--dry-run] [--only norm,act,rope,cache,decode,prefill]
        [--rep MS] [--warmup MS] [--rounds N] [--decode-splits 1,4,16]
        [--tune [--tune-budget-s S]]

--tune: after the sections, every launch config of the attention sweeps
(pdserve/kernels/configs.py) on the bar shapes, each checked then timed, a table per
shape with the default marked (bench/kernels_tune.py).

--dry-run: no GPU needed. Runs everything on the CPU with tiny shapes in
float32 (Triton's interpreter has no bf16; TRITON_INTERPRET=1 is set), timing
with a host clock: checks the script's own logic, not the kernels' speed.
"""

# One file (over 450 lines) on purpose: the issue asks for one GPU script, which the lent machine runs as is.

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DRY = "--dry-run" in sys.argv
if DRY or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import triton  # noqa: E402
import triton.testing  # noqa: E402

# --------------------------------------------------------------------- imports


def _map_pdserve() -> str:
    """Make `pdserve.kernels` / `pdserve.workers` importable.

    Installed (editable) in the dev venv; on the GPU machine it is not, and
    `pdserve/__init__.py` imports transformers, which is not there either. So map
    the source folders onto empty package modules without running that file.
    """
    try:
        importlib.import_module("pdserve.kernels")
        return "installed"
    except Exception:
        for name in [m for m in sys.modules if m == "pdserve" or m.startswith("pdserve.")]:
            del sys.modules[name]
    folders = (("pdserve", "pdserve"), ("pdserve.kernels", "pdserve/kernels"), ("pdserve.workers", "workers"))
    for name, folder in folders:
        mod = types.ModuleType(name)
        mod.__path__ = [str(ROOT / folder)]
        mod.__package__ = name
        sys.modules[name] = mod
    sys.modules["pdserve"].kernels = sys.modules["pdserve.kernels"]  # type: ignore[attr-defined]
    sys.modules["pdserve"].workers = sys.modules["pdserve.workers"]  # type: ignore[attr-defined]
    return f"mapped from {ROOT}"


IMPORT_MODE = _map_pdserve()


class Missing(Exception):
    """A kernel module is not there (yet): its rows are skipped, not failed."""


def _load(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise Missing(f"{module}.{name}: {type(e).__name__}: {e}") from e


# --------------------------------------------------------------------- plan


@dataclass
class Plan:
    device: torch.device
    dtype: torch.dtype
    rel_tol: float
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    copy_bytes: int = 2 << 30  # per buffer: 4 GiB moved per copy
    matmul_n: int = 8192
    decode_batches: tuple[int, ...] = (1, 8, 64)
    decode_ctxs: tuple[int, ...] = (1024, 4096, 16384)
    decode_check_lens: tuple[int, ...] = (16000, 1000, 517, 37, 16, 1)
    prefill_shapes: tuple[tuple[int, int], ...] = ((1, 1024), (1, 2048), (1, 4096), (1, 8192), (1, 16384), (4, 4096))
    # (seq_len incl. the chunk, chunk length): fresh prompts and chunks after a cached prefix
    prefill_check: tuple[tuple[int, int], ...] = ((1000, 1000), (700, 200), (300, 300), (129, 64))
    norm_shape: tuple[int, int] = (8192, 4096)
    act_check_shape: tuple[int, int] = (67, 14336)
    act_tokens: tuple[int, ...] = (1, 64, 8192)  # decode batch 1 and 64, a prefill chunk
    act_inter: int = 14336  # Llama-3-8B's intermediate size
    rope_kv_tokens: tuple[int, ...] = (1, 64, 8192)
    norm_check_shape: tuple[int, int] = (257, 4096)
    rope_tokens: int = 8192
    rope_check_tokens: int = 129
    cache_tokens: int = 8192
    bar_decode: tuple[int, int] = (64, 4096)
    bar_decode_pct: float = 80.0
    bar_prefill_ratio: float = 0.9
    bar_prefill_min_tokens: int = 4096


def full_plan() -> Plan:
    return Plan(device=torch.device("cuda"), dtype=torch.bfloat16, rel_tol=1e-2)


def dry_plan() -> Plan:
    return Plan(
        device=torch.device("cpu"), dtype=torch.float32, rel_tol=1e-3,
        heads=4, kv_heads=2, head_dim=32, block_size=16,
        copy_bytes=8 << 20, matmul_n=128,
        decode_batches=(1, 2), decode_ctxs=(32, 80), decode_check_lens=(80, 37, 16, 1),
        prefill_shapes=((1, 64), (2, 48)), prefill_check=((70, 70), (50, 20), (33, 1)),
        norm_shape=(16, 64), norm_check_shape=(5, 48), act_check_shape=(5, 40), act_tokens=(1, 6), act_inter=48,
        rope_kv_tokens=(1, 5),
        rope_tokens=8, rope_check_tokens=7,
        cache_tokens=24, bar_decode=(2, 80), bar_prefill_min_tokens=64,
    )


# --------------------------------------------------------------------- results


@dataclass
class Check:
    kernel: str
    case: str
    max_abs: float | None = None
    rel: float | None = None
    status: str = "FAIL"
    note: str = ""


@dataclass
class Perf:
    section: str
    config: str
    us: float | None = None
    rate: float | None = None  # GB/s or TFLOP/s
    unit: str = ""
    pct: float | None = None  # % of the measured ceiling
    ref: str = ""
    ref_us: float | None = None
    ratio: float | None = None  # ours vs ref in rate (>1 = faster)
    note: str = ""


@dataclass
class Bar:
    name: str
    value: float | None
    target: str
    met: bool | None


@dataclass
class Report:
    header: dict = field(default_factory=dict)
    ceilings: dict = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    perf: list[Perf] = field(default_factory=list)
    bars: list[Bar] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class Runner:
    def __init__(self, plan: Plan, args: argparse.Namespace) -> None:
        self.p = plan
        self.args = args
        self.r = Report()
        self.broken = ""  # set after a CUDA error: the context is gone, skip the rest
        self.sweep = None  # kernels_tune.Sweep after --tune
        self.gen_seed = 1234

    # ---------------- helpers

    def log(self, msg: str) -> None:
        print(msg, flush=True)

    def sync(self) -> None:
        if self.p.device.type == "cuda":
            torch.cuda.synchronize()

    def randn(self, *shape: int, dtype: torch.dtype | None = None, scale: float = 1.0) -> torch.Tensor:
        """Fresh random data every call (never zeros)."""
        self.gen_seed += 1
        g = torch.Generator(device=self.p.device).manual_seed(self.gen_seed)
        t = torch.randn(*shape, generator=g, device=self.p.device,
                        dtype=torch.float32 if dtype in (None, torch.float64) else dtype)
        if scale != 1.0:
            t.mul_(scale)
        return t.to(dtype or self.p.dtype)

    def randperm(self, n: int) -> torch.Tensor:
        self.gen_seed += 1
        g = torch.Generator(device="cpu").manual_seed(self.gen_seed)
        return torch.randperm(n, generator=g)

    def bench(self, fn: Callable[[], object]) -> float:
        """Median milliseconds."""
        if self.p.device.type == "cuda":
            return float(triton.testing.do_bench(fn, warmup=self.args.warmup, rep=self.args.rep, return_mode="median"))
        # The CPU is the dry run: its host clock says nothing of a GPU's speed, and each call
        # under the interpreter costs up to a second, so one timed call (no warm-up: the
        # interpreter compiles nothing) is what the script's logic needs.
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def poison_allocator(self, nbytes: int) -> None:
        """Leave NaN in the caching allocator's free blocks so a kernel's fresh
        `torch.empty` output likely starts as NaN (best effort; CPU: no effect)."""
        if self.p.device.type == "cuda" and nbytes > 0:
            buf = torch.full((nbytes // 2 + 1024,), float("nan"), dtype=torch.bfloat16, device=self.p.device)
            del buf

    def guarded(self, what: str, fn: Callable[[], None]) -> None:
        """Run a section; record errors; stop touching the GPU after a CUDA error."""
        if self.broken:
            self.r.errors.append(f"{what}: skipped ({self.broken})")
            self.log(f"[skip] {what}: {self.broken}")
            return
        try:
            fn()
            self.sync()
        except Missing as e:
            self.r.errors.append(f"{what}: not available: {e}")
            self.log(f"[missing] {what}: {e}")
        except Exception as e:  # noqa: BLE001 - a benchmark reports and moves on
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.r.errors.append(f"{what}: {msg}")
            self.log(f"[error] {what}: {msg}")
            traceback.print_exc()
            if "CUDA" in str(e) or "cuda" in type(e).__name__.lower() or "illegal" in str(e).lower():
                self.broken = f"CUDA error in {what}"
        finally:
            if self.p.device.type == "cuda" and not self.broken:
                torch.cuda.empty_cache()

    def compare(self, kernel: str, case: str, out: torch.Tensor, ref: torch.Tensor, tol: float | None = None,
                note: str = "") -> Check:
        tol = self.p.rel_tol if tol is None else tol
        o = out.double()
        finite = bool(torch.isfinite(o).all())
        diff = (o - ref).abs()
        max_abs = float(diff.max()) if diff.numel() else 0.0
        rel = float((o - ref).norm() / ref.norm().clamp_min(1e-300)) if diff.numel() else 0.0
        ok = finite and rel <= tol and not math.isnan(rel)
        notes = [] if finite else [f"{int((~torch.isfinite(o)).sum())} non-finite (unwritten?)"]
        if note:
            notes.append(note)
        c = Check(kernel, case, max_abs, rel, "PASS" if ok else "FAIL", "; ".join(notes))
        self.r.checks.append(c)
        self.log(f"  check {kernel:<10} {case:<36} max_abs={max_abs:.3e} rel={rel:.3e} {c.status} {c.note}")
        return c

    def perf(self, row: Perf) -> Perf:
        self.r.perf.append(row)
        self.log("  perf  " + _perf_line(row))
        return row

    # ---------------- paged cache helpers

    def paged(self, seq_lens: list[int], fill: bool = True):
        """Block tables over a shuffled pool of blocks, and a random cache."""
        bs, p = self.p.block_size, self.p
        per = [-(-n // bs) for n in seq_lens]
        num_blocks = sum(per) + 3  # a few blocks nobody owns
        perm = self.randperm(num_blocks)
        max_blocks = max(per)
        table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
        at = 0
        for i, n in enumerate(per):
            table[i, :n] = perm[at : at + n].to(torch.int32)
            at += n
        shape = (num_blocks, bs, p.kv_heads, p.head_dim)
        if fill:
            k_cache, v_cache = self.randn(*shape), self.randn(*shape)
        else:
            k_cache = torch.empty(shape, dtype=p.dtype, device=p.device)
            v_cache = torch.empty(shape, dtype=p.dtype, device=p.device)
        return table.to(p.device), k_cache, v_cache

    def slots(self, table: torch.Tensor, seq_lens: list[int], q_lens: list[int]) -> torch.Tensor:
        """Flat slot of every new token (the last q_len positions of each sequence)."""
        bs = self.p.block_size
        tab = table.cpu().long()
        out = []
        for i, (n, q) in enumerate(zip(seq_lens, q_lens)):
            pos = torch.arange(n - q, n)
            out.append(tab[i, pos // bs] * bs + pos % bs)
        return torch.cat(out).to(self.p.device)

    def seq_tensors(self, seq_lens: list[int], q_lens: list[int]):
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        dev = self.p.device
        return (torch.tensor(seq_lens, dtype=torch.int32, device=dev), torch.tensor(qsl, dtype=torch.int32, device=dev))

    def attn_ref64(self, q, k_cache, v_cache, table, seq_lens: list[int], q_lens: list[int],
                   scale: float) -> torch.Tensor:
        """Float64 causal attention over the paged cache, one sequence at a time."""
        H, KVH, bs = q.shape[1], k_cache.shape[2], k_cache.shape[1]
        outs, start = [], 0
        tab = table.long()
        for i, (n, ql) in enumerate(zip(seq_lens, q_lens)):
            blocks = tab[i, : -(-n // bs)]
            k = k_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(H // KVH, dim=1)  # [L, H, D]
            v = v_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(H // KVH, dim=1)
            qq = q[start : start + ql].double()
            s = torch.einsum("nhd,lhd->hnl", qq, k) * scale
            qpos = torch.arange(n - ql, n, device=q.device)
            kpos = torch.arange(n, device=q.device)
            s.masked_fill_(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
            outs.append(torch.einsum("hnl,lhd->nhd", torch.softmax(s, dim=-1), v))
            start += ql
        return torch.cat(outs)

    # ---------------- sections

    def header(self) -> None:
        h = self.r.header
        h["command"] = shlex.join([sys.executable, *sys.argv])
        h["torch"] = torch.__version__
        h["triton"] = triton.__version__
        h["cuda"] = torch.version.cuda
        h["python"] = platform.python_version()
        h["host"] = platform.node()
        h["pdserve_import"] = IMPORT_MODE
        h["dry_run"] = DRY
        h["time"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        if self.p.device.type == "cuda":
            props = torch.cuda.get_device_properties(0)
            h["device"] = props.name
            h["capability"] = f"sm_{props.major}{props.minor}"
            h["sms"] = props.multi_processor_count
            h["memory_gib"] = round(props.total_memory / 2**30, 1)
            h["l2_mib"] = round(getattr(props, "L2_cache_size", 0) / 2**20, 1)
        else:
            h["device"] = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores) - dry run"
        self.log("device: " + json.dumps(h))

    def ceilings(self) -> None:
        p = self.p
        cdt = torch.bfloat16 if p.device.type == "cuda" else torch.float32
        src = self.randn(p.copy_bytes // _esize(cdt), dtype=cdt)
        dst = torch.empty_like(src)
        ms = self.bench(lambda: dst.copy_(src))
        moved = 2 * src.numel() * src.element_size()
        self.r.ceilings["copy_gbps"] = moved / (ms * 1e-3) / 1e9
        self.r.ceilings["copy_bytes"] = moved
        self.r.ceilings["copy_us"] = ms * 1e3
        assert torch.equal(dst, src), "copy_ mismatch"
        del src, dst
        self.log(f"copy bandwidth: {self.r.ceilings['copy_gbps']:.0f} GB/s "
                 f"({_bytes(moved)} read+write, {ms * 1e3:.0f} us)")
        if self.p.device.type == "cuda":
            torch.cuda.empty_cache()
        m = p.matmul_n
        a, b = self.randn(m, m, dtype=p.dtype), self.randn(m, m, dtype=p.dtype)
        ms = self.bench(lambda: a @ b)
        self.r.ceilings["matmul_tflops"] = 2 * m**3 / (ms * 1e-3) / 1e12
        self.log(f"{str(p.dtype).split('.')[-1]} matmul {m}^3: {self.r.ceilings['matmul_tflops']:.1f} TFLOP/s")

    @property
    def bw(self) -> float | None:
        return self.r.ceilings.get("copy_gbps")

    def pct_bw(self, gbps: float) -> float | None:
        return 100.0 * gbps / self.bw if self.bw else None

    # decode -------------------------------------------------------------

    def decode(self) -> None:
        decode = _load("pdserve.kernels.triton_decode", "paged_decode_attention")
        p = self.p
        scale = p.head_dim**-0.5
        # correctness: mixed lengths (block-size multiples and not), several split counts
        lens = list(p.decode_check_lens)
        for splits in (None, 1, 4):
            table, kc, vc = self.paged(lens)
            q = self.randn(len(lens), p.heads, p.head_dim)
            seq_lens, qsl = self.seq_tensors(lens, [1] * len(lens))
            out = torch.full_like(q, float("nan"))
            got = decode(q, kc, vc, table, seq_lens, qsl, scale, 1, num_splits=splits, out=out)
            self.sync()
            ref = self.attn_ref64(q, kc, vc, table, lens, [1] * len(lens), scale)
            note = "" if got is out else "returned a new tensor, not out="
            self.compare("decode", f"lens={_short(lens)} splits={splits}", got, ref, note=note)
        # timing
        extra_splits = [int(s) for s in self.args.decode_splits.split(",") if s] if self.args.decode_splits else []
        for b in p.decode_batches:
            for ctx in p.decode_ctxs:
                kv_bytes = b * ctx * p.kv_heads * p.head_dim * _esize(p.dtype) * 2
                cfg = f"b={b} ctx={_k(ctx)}"
                if p.device.type == "cuda":
                    free = torch.cuda.mem_get_info()[0]
                    if kv_bytes * 1.1 + (1 << 30) > free:
                        self.perf(Perf("decode", cfg,
                                       note=f"skipped: needs {kv_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} free"))
                        continue
                table, kc, vc = self.paged([ctx] * b)
                q = self.randn(b, p.heads, p.head_dim)
                seq_lens, qsl = self.seq_tensors([ctx] * b, [1] * b)
                out = torch.full_like(q, float("nan"))
                moved = kv_bytes + 2 * q.numel() * q.element_size()
                for splits in [None, *extra_splits]:
                    fn = lambda s=splits: decode(q, kc, vc, table, seq_lens, qsl, scale, 1, num_splits=s, out=out)  # noqa: E731
                    fn()
                    self.sync()
                    note = "" if bool(torch.isfinite(out).all()) else "NON-FINITE OUTPUT"
                    ms = self.bench(fn)
                    gbps = moved / (ms * 1e-3) / 1e9
                    self.perf(Perf("decode", cfg + ("" if splits is None else f" splits={splits}"), ms * 1e3, gbps,
                                   "GB/s", self.pct_bw(gbps), note=note))
                    if (b, ctx) == p.bar_decode and splits is None:
                        pct = self.pct_bw(gbps)
                        self.r.bars.append(Bar(f"decode {cfg} >= {p.bar_decode_pct:.0f}% of copy bandwidth", pct,
                                               f">= {p.bar_decode_pct:.0f}%",
                                               None if pct is None else pct >= p.bar_decode_pct))
                del table, kc, vc, q, out
                if p.device.type == "cuda":
                    torch.cuda.empty_cache()

    # prefill ------------------------------------------------------------

    def write_cache(self, k, v, kc, vc, slot_mapping) -> str:
        try:
            write_kv = _load("pdserve.kernels.triton_cache", "write_kv")
            write_kv(k, v, kc, vc, slot_mapping)
            return "triton write_kv"
        except Missing:
            ns = kc.shape[0] * kc.shape[1]
            kc.view(ns, *kc.shape[2:]).index_copy_(0, slot_mapping, k)
            vc.view(ns, *vc.shape[2:]).index_copy_(0, slot_mapping, v)
            return "index_copy_ (write_kv missing)"

    def prefill(self) -> None:
        prefill = _load("pdserve.kernels.triton_prefill", "prefill_attention")
        scale = self.p.head_dim**-0.5
        self.prefill_check(prefill, scale)
        for nseq, s in self.p.prefill_shapes:  # timing vs SDPA, A B A B
            self.prefill_timing(prefill, scale, nseq, s)

    def prefill_check(self, prefill: Callable, scale: float) -> None:
        """Correctness: fresh prompts and chunks behind a cached prefix, in one batch, against float64."""
        p = self.p
        lens = [n for n, _ in p.prefill_check]
        qls = [q for _, q in p.prefill_check]
        table, kc, vc = self.paged(lens)
        q = self.randn(sum(qls), p.heads, p.head_dim)
        seq_lens, qsl = self.seq_tensors(lens, qls)
        out = torch.full_like(q, float("nan"))
        got = prefill(q, kc, vc, table, seq_lens, qsl, scale, max(qls), out=out)
        self.sync()
        ref = self.attn_ref64(q, kc, vc, table, lens, qls, scale)
        self.compare("prefill", "(seq,chunk)=" + ",".join(f"({n},{c})" for n, c in p.prefill_check), got, ref,
                     note="" if got is out else "returned a new tensor, not out=")
        del table, kc, vc, q, out, got, ref

    def prefill_timing(self, prefill: Callable, scale: float, nseq: int, s: int) -> None:
        """`nseq` sequences of `s` tokens: checked against SDPA's flash backend, then both timed in turns."""
        p = self.p
        cfg = f"{nseq}x{_k(s)}"
        tokens = nseq * s
        table, kc, vc = self.paged([s] * nseq, fill=False)
        q = self.randn(tokens, p.heads, p.head_dim)
        k = self.randn(tokens, p.kv_heads, p.head_dim)
        v = self.randn(tokens, p.kv_heads, p.head_dim)
        how = self.write_cache(k, v, kc, vc, self.slots(table, [s] * nseq, [s] * nseq))
        seq_lens, qsl = self.seq_tensors([s] * nseq, [s] * nseq)
        out = torch.full_like(q, float("nan"))
        ours = lambda: prefill(q, kc, vc, table, seq_lens, qsl, scale, s, out=out)  # noqa: E731
        ours()
        self.sync()
        flops = nseq * 2 * s * s * p.heads * p.head_dim  # causal: half of 4 S^2 H D
        # SDPA inputs in their best layout, built outside the timing
        qs = q.view(nseq, s, p.heads, p.head_dim).transpose(1, 2).contiguous()
        ks = k.view(nseq, s, p.kv_heads, p.head_dim).transpose(1, 2).contiguous()
        vs = v.view(nseq, s, p.kv_heads, p.head_dim).transpose(1, 2).contiguous()
        sdpa, sdpa_name = self.sdpa_fn(qs, ks, vs, scale, "flash")
        ref_out = sdpa()
        self.sync()
        got_bhsd = out.view(nseq, s, p.heads, p.head_dim).transpose(1, 2)
        self.compare("prefill", f"{cfg} vs {sdpa_name} (both {_dt(p.dtype)})", got_bhsd, ref_out.double(),
                     tol=2 * p.rel_tol, note=how)
        del ref_out
        ours_ms, ref_ms = [], []
        for _ in range(max(1, self.args.rounds)):
            ours_ms.append(self.bench(ours))
            ref_ms.append(self.bench(sdpa))
        o_ms, r_ms = statistics.median(ours_ms), statistics.median(ref_ms)
        spread = (max(ours_ms) - min(ours_ms)) / min(ours_ms) * 100
        tflops = flops / (o_ms * 1e-3) / 1e12
        mm = self.r.ceilings.get("matmul_tflops")
        row = self.perf(Perf("prefill", cfg, o_ms * 1e3, tflops, "TFLOP/s", 100 * tflops / mm if mm else None,
                             sdpa_name, r_ms * 1e3, r_ms / o_ms,
                             note=f"spread {spread:.0f}% over {len(ours_ms)} rounds"))
        row.note += self.cudnn_note(qs, ks, vs, scale, o_ms)
        if tokens >= p.bar_prefill_min_tokens:
            ratio = row.ratio
            self.r.bars.append(Bar(f"prefill {cfg} >= {p.bar_prefill_ratio}x {sdpa_name}", ratio,
                                   f">= {p.bar_prefill_ratio}x",
                                   None if ratio is None else ratio >= p.bar_prefill_ratio))
        del table, kc, vc, q, k, v, qs, ks, vs, out
        if p.device.type == "cuda":
            torch.cuda.empty_cache()

    def cudnn_note(self, qs, ks, vs, scale: float, ours_ms: float) -> str:
        """cuDNN attention on the same inputs, for information only: a note for the prefill row."""
        try:
            cudnn, cudnn_name = self.sdpa_fn(qs, ks, vs, scale, "cudnn")
            if self.p.device.type == "cuda" and cudnn_name.startswith("sdpa-cudnn"):
                c_ms = self.bench(cudnn)
                return f"; {cudnn_name} {c_ms * 1e3:.0f} us (ours {c_ms / ours_ms:.2f}x)"
        except Exception as e:  # noqa: BLE001
            return f"; cudnn n/a ({type(e).__name__})"
        return ""

    def sdpa_fn(self, qs, ks, vs, scale: float, backend: str):
        """A timed SDPA call on [B, H, S, D] / [B, KVH, S, D]: GQA natively, else K/V repeated."""
        import torch.nn.functional as F

        if self.p.device.type != "cuda":
            name = "sdpa-cpu"
            fn = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)  # noqa: E731
            fn()
            return fn, name
        from torch.nn.attention import SDPBackend, sdpa_kernel

        be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

        def gqa():
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)

        try:
            gqa()
            self.sync()
            return gqa, f"sdpa-{backend}"
        except RuntimeError:
            group = qs.shape[1] // ks.shape[1]
            kr = ks.repeat_interleave(group, dim=1).contiguous()
            vr = vs.repeat_interleave(group, dim=1).contiguous()

            def rep():
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(qs, kr, vr, is_causal=True, scale=scale)

            rep()
            self.sync()
            return rep, f"sdpa-{backend}(kv repeated)"

    # write_kv -------------------------------------------------------------

    def cache(self) -> None:
        write_kv = _load("pdserve.kernels.triton_cache", "write_kv")
        p = self.p
        for tokens, label in ((p.rope_check_tokens, "check"), (p.cache_tokens, "timing")):
            nb = -(-tokens // p.block_size) * 2
            shape = (nb, p.block_size, p.kv_heads, p.head_dim)
            kc = torch.full(shape, float("nan"), dtype=p.dtype, device=p.device)
            vc = torch.full(shape, float("nan"), dtype=p.dtype, device=p.device)
            slot_mapping = self.randperm(nb * p.block_size)[:tokens].to(p.device)
            k = self.randn(tokens, p.kv_heads, p.head_dim)
            v = self.randn(tokens, p.kv_heads, p.head_dim)
            write_kv(k, v, kc, vc, slot_mapping)
            self.sync()
            flat_k, flat_v = kc.view(-1, p.kv_heads, p.head_dim), vc.view(-1, p.kv_heads, p.head_dim)
            untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=p.device)
            untouched[slot_mapping] = False
            exact = torch.equal(flat_k[slot_mapping], k) and torch.equal(flat_v[slot_mapping], v)
            clean = bool(torch.isnan(flat_k[untouched]).all()) and bool(torch.isnan(flat_v[untouched]).all())
            if label == "check":
                c = Check("write_kv", f"T={tokens} random slots", 0.0 if exact else None, 0.0 if exact else None,
                          "PASS" if exact and clean else "FAIL",
                          "" if clean else "wrote outside its slots")
                self.r.checks.append(c)
                self.log(f"  check write_kv   T={tokens}: exact={exact} others untouched={clean} {c.status}")
                continue
            ms = self.bench(lambda: write_kv(k, v, kc, vc, slot_mapping))
            moved = 4 * k.numel() * k.element_size() + slot_mapping.numel() * 8
            gbps = moved / (ms * 1e-3) / 1e9
            self.perf(Perf("write_kv", f"T={tokens} KVH={p.kv_heads} D={p.head_dim}", ms * 1e3, gbps, "GB/s",
                           self.pct_bw(gbps)))

    # norm ---------------------------------------------------------------

    def norm(self) -> None:
        fused = _load("pdserve.kernels.triton_norm", "fused_add_rms_norm")
        p = self.p
        eps = 1e-5
        T, H = p.norm_check_shape
        for with_res in (True, False):
            x = self.randn(T, H, scale=2.0)
            res = self.randn(T, H) if with_res else None
            w = (1 + 0.2 * self.randn(H, dtype=torch.float32)).to(p.dtype)
            self.poison_allocator(2 * T * H * _esize(p.dtype))
            out, new_res = fused(x, res, w, eps)
            self.sync()
            h = x if res is None else x + res  # the residual add rounds to the dtype, as in torch
            h64 = h.double()
            ref = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps) * w.double()
            self.compare("rms_norm", f"{T}x{H} residual={'yes' if with_res else 'None'}", out, ref)
            if not torch.equal(new_res, h):
                self.r.checks[-1].status = "FAIL"
                self.r.checks[-1].note += " new_residual != x + residual"
        T, H = p.norm_shape
        layer_fn = self._torch_norm(H, eps)
        for with_res in (True, False):
            x = self.randn(T, H)
            res = self.randn(T, H) if with_res else None
            w = self.randn(H)
            ms = self.bench(lambda: fused(x, res, w, eps))
            ref_ms = self.bench(lambda: layer_fn(x, res, w))
            moved = (4 if with_res else 2) * T * H * _esize(p.dtype) + H * _esize(p.dtype)
            gbps = moved / (ms * 1e-3) / 1e9
            self.perf(Perf("rms_norm", f"{T}x{H} residual={'yes' if with_res else 'None'}", ms * 1e3, gbps, "GB/s",
                           self.pct_bw(gbps), "torch eager", ref_ms * 1e3, ref_ms / ms))

    def _torch_norm(self, H: int, eps: float):
        import torch.nn.functional as F

        def fn(x, res, w):  # layers.RMSNorm.forward, half-precision branch
            if res is not None:
                x = x + res
            if x.dtype == torch.float32:
                return F.rms_norm(x, (H,), w, eps), x
            return F.rms_norm(x.float(), (H,), None, eps).to(x.dtype) * w, x

        return fn

    # act (SiLU x mul) -----------------------------------------------------

    def act(self) -> None:
        silu_and_mul = _load("pdserve.kernels.triton_act", "silu_and_mul")
        import torch.nn.functional as F

        p = self.p
        T, inter = p.act_check_shape
        gate_up = self.randn(T, 2 * inter, scale=3.0)
        out = silu_and_mul(gate_up)
        self.sync()
        g, u = gate_up[:, :inter].double(), gate_up[:, inter:].double()
        self.compare("silu_mul", f"{T}x{inter}", out, g * torch.sigmoid(g) * u)
        for T in p.act_tokens:
            inter = p.act_inter
            gate_up = self.randn(T, 2 * inter)

            def torch_two_ops(x=gate_up, n=inter):  # layers.GatedMLP's eager path
                gate, up = x.split(n, dim=-1)
                return F.silu(gate).mul_(up)

            ms = self.bench(lambda: silu_and_mul(gate_up))
            ref_ms = self.bench(torch_two_ops)
            moved = 3 * T * inter * _esize(p.dtype)
            gbps = moved / (ms * 1e-3) / 1e9
            self.perf(Perf("silu_mul", f"T={T} I={inter}", ms * 1e3, gbps, "GB/s", self.pct_bw(gbps),
                           "torch eager", ref_ms * 1e3, ref_ms / ms))

    # rope ---------------------------------------------------------------

    def rope(self) -> None:
        apply_rope = _load("pdserve.kernels.triton_rope", "apply_rope")
        rope_cos_sin = _load("pdserve.kernels.triton_rope", "rope_cos_sin")
        cfg_mod = importlib.import_module("pdserve.workers.model.config")
        p = self.p
        rope = cfg_mod.RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192)
        D = p.head_dim
        nqk, nqkv = p.heads + p.kv_heads, p.heads + 2 * p.kv_heads  # q and k rotated together, v left out
        inv_freq = cfg_mod.rope_inv_freq(rope, D).to(p.device)
        max_pos = max(p.rope_tokens, 32768)
        cos, sin = rope_cos_sin(inv_freq, max_pos, p.dtype)
        half = D // 2

        def ref64(x, positions):
            c, s = cos[positions].double()[:, None], sin[positions].double()[:, None]
            x64 = x.double()
            return torch.cat((x64[..., :half] * c - x64[..., half:] * s, x64[..., half:] * c + x64[..., :half] * s), -1)

        T = p.rope_check_tokens
        qkv = self.randn(T, nqkv * D)
        x = qkv.view(T, nqkv, D)[:, :nqk]  # strided view, as in the model
        self.gen_seed += 1
        positions = torch.randint(0, max_pos, (T,), generator=torch.Generator().manual_seed(self.gen_seed)).to(p.device)
        self.poison_allocator(x.numel() * _esize(p.dtype))
        out = apply_rope(x, positions, cos, sin)
        self.sync()
        self.compare("rope", f"T={T} heads={nqk}/{nqkv} D={D} llama3", out, ref64(x, positions))
        # timing: prefill-like positions 0..T-1 on the q+k slice of a fused qkv output
        T = p.rope_tokens
        qkv = self.randn(T, nqkv * D)
        x = qkv.view(T, nqkv, D)[:, :nqk]
        positions = torch.arange(T, device=p.device)
        cos_full = torch.cat((cos, cos), -1)
        sin_signed = torch.cat((-sin, sin), -1)

        def torch_rope():  # layers.RotaryEmbedding.lookup + apply
            c, s = cos_full[positions].unsqueeze(1), sin_signed[positions].unsqueeze(1)
            return torch.addcmul(x * c, x.roll(half, dims=-1), s)

        ms = self.bench(lambda: apply_rope(x, positions, cos, sin))
        ref_ms = self.bench(torch_rope)
        moved = 2 * T * nqk * D * _esize(p.dtype) + T * D * _esize(p.dtype) + T * 8
        gbps = moved / (ms * 1e-3) / 1e9
        self.perf(Perf("rope", f"T={T} heads={nqk} D={D} (strided)", ms * 1e3, gbps, "GB/s", self.pct_bw(gbps),
                       "torch eager", ref_ms * 1e3, ref_ms / ms))
        self._rope_kv(cos, sin)

    def _rope_kv(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """RoPE + the KV write in one launch (the Triton model's path) against the two kernels
        it replaced: equal bit for bit, and timed at decode batch 1 and 64 and a prefill chunk."""
        rope_and_write_kv = _load("pdserve.kernels.triton_rope_cache", "rope_and_write_kv")
        apply_rope = _load("pdserve.kernels.triton_rope", "apply_rope")
        write_kv = _load("pdserve.kernels.triton_cache", "write_kv")
        p = self.p
        H, KVH, D = p.heads, p.kv_heads, p.head_dim
        for T in p.rope_kv_tokens:
            num_blocks = -(-T // p.block_size) + 1
            shape = (num_blocks, p.block_size, KVH, D)
            caches = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(4)]
            qkv = self.randn(T, (H + 2 * KVH) * D)
            positions = torch.arange(T, device=p.device) + 100
            slots = self.randperm(num_blocks * p.block_size)[:T].to(p.device)

            def two_kernels(kc=caches[0], vc=caches[1], qkv=qkv, positions=positions, slots=slots, T=T):
                qk = apply_rope(qkv[:, : (H + KVH) * D].view(T, H + KVH, D), positions, cos, sin)
                write_kv(qk[:, H:], qkv[:, (H + KVH) * D:].view(T, KVH, D), kc, vc, slots)
                return qk[:, :H]

            def fused(kc=caches[2], vc=caches[3], qkv=qkv, positions=positions, slots=slots):
                return rope_and_write_kv(qkv, H, KVH, positions, cos, sin, kc, vc, slots)

            same = torch.equal(two_kernels(), fused()) and torch.equal(caches[0], caches[2]) and \
                torch.equal(caches[1], caches[3])
            self.r.checks.append(Check("rope_kv", f"T={T} vs rope + write_kv", 0.0, 0.0, "PASS" if same else "FAIL",
                                       "" if same else "differs from the two kernels"))
            ms = self.bench(fused)
            ref_ms = self.bench(two_kernels)
            moved = (T * (H + 2 * KVH) * D + T * H * D + 2 * T * KVH * D) * _esize(p.dtype)
            gbps = moved / (ms * 1e-3) / 1e9
            self.perf(Perf("rope_kv", f"T={T} H={H} KVH={KVH} D={D}", ms * 1e3, gbps, "GB/s", self.pct_bw(gbps),
                           "rope + write_kv", ref_ms * 1e3, ref_ms / ms))

    # tune ---------------------------------------------------------------

    def tune(self) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import kernels_tune

        self.sweep = kernels_tune.Sweep(self, self.args.tune_budget_s)  # kept if the sweep dies midway
        kernels_tune.run_sweep(self.sweep, dry=DRY)

    # summary ------------------------------------------------------------

    def summary(self) -> str:
        r, h, c = self.r, self.r.header, self.r.ceilings
        lines = ["", "=" * 100, "kernels_gpu summary", "=" * 100]
        dev = f"device : {h.get('device')}"
        if "sms" in h:
            dev += f" ({h['capability']}, {h['sms']} SMs, {h['memory_gib']} GiB, L2 {h['l2_mib']} MiB)"
        lines.append(dev)
        lines.append(f"stack  : torch {h['torch']}, triton {h['triton']}, CUDA {h['cuda']}, python {h['python']}, "
                     f"pdserve {h['pdserve_import']}")
        lines.append(f"command: {h['command']}")
        if c:
            lines.append(f"ceilings: copy {c.get('copy_gbps', float('nan')):.0f} GB/s "
                         f"({_bytes(c.get('copy_bytes', 0))} read+write, median); "
                         f"matmul {c.get('matmul_tflops', float('nan')):.1f} TFLOP/s ({self.p.matmul_n}^3)")
        dt = _dt(self.p.dtype)
        lines += ["", f"correctness ({dt} vs float64 on fresh random inputs, outputs NaN-poisoned; "
                      f"rel = ||out-ref||/||ref||, tol {self.p.rel_tol:g})"]
        lines.append(f"{'kernel':<10} {'case':<48} {'max_abs':>10} {'rel':>10}  result")
        for k in r.checks:
            lines.append(f"{k.kernel:<10} {k.case:<48} {_f(k.max_abs, '.2e'):>10} {_f(k.rel, '.2e'):>10}  "
                         f"{k.status} {k.note}")
        timer = "host clock, dry run: no speed signal" if DRY else "median of triton.testing.do_bench, L2 flushed"
        lines += ["", f"performance ({timer}; %lim = % of measured copy bw (GB/s rows) or matmul rate (TFLOP/s rows);"
                  " ours/ref = ref time / our time, >1 = ours faster)"]
        lines.append(_perf_header())
        for row in r.perf:
            lines.append(_perf_line(row))
        if self.sweep is not None:
            lines += self.sweep.table()
        lines += ["", "bars"]
        for b in r.bars:
            met = "n/a" if b.met is None else ("met" if b.met else "NOT met")
            val = "n/a" if b.value is None else (f"{b.value:.1f}%" if "%" in b.target else f"{b.value:.2f}x")
            lines.append(f"  {b.name:<60} {val:>8}  target {b.target:<8} {met}")
        if r.errors:
            lines += ["", "errors / skipped"] + [f"  {e}" for e in r.errors]
        n_fail = sum(k.status != "PASS" for k in r.checks)
        lines.append("")
        lines.append(f"checks: {len(r.checks) - n_fail}/{len(r.checks)} PASS; bars: "
                     f"{sum(b.met is True for b in r.bars)}/{len(r.bars)} met; errors: {len(r.errors)}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "header": self.r.header, "ceilings": self.r.ceilings,
            "checks": [asdict(c) for c in self.r.checks], "perf": [asdict(x) for x in self.r.perf],
            "bars": [asdict(b) for b in self.r.bars], "errors": self.r.errors,
            "tuning": self.sweep.to_json() if self.sweep is not None else [],
            "plan": {k: (str(v) if isinstance(v, (torch.device, torch.dtype)) else v)
                     for k, v in asdict(self.p).items()},
        }


# --------------------------------------------------------------------- formatting


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def _esize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def _bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _short(xs: list[int]) -> str:
    return "[" + ",".join(map(str, xs)) + "]"


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _perf_header() -> str:
    return (f"{'section':<9} {'config':<30} {'us':>9} {'rate':>9} {'unit':<8} {'%lim':>6}  "
            f"{'vs':<18} {'ref us':>9} {'ours/ref':>8}  note")


def _perf_line(r: Perf) -> str:
    return (f"{r.section:<9} {r.config:<30} {_f(r.us, '.1f'):>9} "
            f"{_f(r.rate, '.1f' if (r.rate or 0) >= 10 else '.3g'):>9} {r.unit:<8} {_f(r.pct, '.1f'):>6}  "
            f"{r.ref:<18} {_f(r.ref_us, '.1f'):>9} {_f(r.ratio, '.2f'):>8}  {r.note}")


# --------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton interpreter), float32")
    ap.add_argument("--only", default="norm,act,rope,cache,decode,prefill",
                    help="comma list of sections: norm,act,rope,cache,decode,prefill (the ceilings always run)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up time, ms")
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds for prefill vs SDPA")
    ap.add_argument("--decode-splits", default="", help="extra num_splits values to time for decode, e.g. 1,4,16")
    ap.add_argument("--tune", action="store_true",
                    help="after the sections, time every config of the attention sweeps on the bar shapes")
    ap.add_argument("--tune-budget-s", type=float, default=240.0, help="stop the --tune sweep after this long")
    args = ap.parse_args(argv)

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU machine", file=sys.stderr)
        return 2
    plan = dry_plan() if args.dry_run else full_plan()
    if args.dry_run:
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    run = Runner(plan, args)
    t0 = time.perf_counter()
    run.header()
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    # The ceilings come first: every % below divides by them.
    run.guarded("ceilings", run.ceilings)
    for name in ("norm", "act", "rope", "cache", "decode", "prefill"):
        if name in sections:
            run.log(f"== {name}")
            run.guarded(name, getattr(run, name))
    if args.tune:
        run.log("== tune")
        run.guarded("tune", run.tune)
    run.r.header["wall_s"] = round(time.perf_counter() - t0, 1)
    text = run.summary() + f"\nwall: {run.r.header['wall_s']} s"
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "kernels_gpu.json").write_text(json.dumps(run.to_json(), indent=1, default=str))
        (Path(out_dir) / "kernels_gpu.txt").write_text(text + "\n")
    print(text, flush=True)
    failed = any(c.status != "PASS" for c in run.r.checks) or bool(run.broken)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
