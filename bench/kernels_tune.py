"""The `--tune` section of bench/kernels_gpu.py: every launch config of the
attention sweeps (pdserve/kernels/configs.py) timed on the shapes of the bars.

Per shape, each config runs once and is checked against a reference (decode:
float64 attention over the paged cache; prefill: SDPA flash, both bf16),
then timed with the runner's `do_bench` median. SDPA is timed right after the
prefill configs of each shape (same warm card). The default config is timed
in the same loop, so its row and the winner's are side by side. A time
budget stops the sweep early (rows left are listed as skipped): the device
is lent for minutes.

Result: a table per shape, best first, and a line per kernel naming the
config to make the default if it beats the current one.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class TuneRow:
    kernel: str
    shape: str
    config: str
    us: float | None = None
    rate: float | None = None  # GB/s (decode) or TFLOP/s (prefill)
    score: float | None = None  # % of copy bandwidth (decode) or x SDPA (prefill)
    rel: float | None = None  # ||out - ref|| / ||ref||
    default: bool = False
    note: str = ""


class Sweep:
    def __init__(self, runner, budget_s: float) -> None:
        self.run = runner
        self.rows: list[TuneRow] = []
        self.deadline = time.perf_counter() + budget_s

    def out_of_time(self, row: TuneRow) -> bool:
        if time.perf_counter() < self.deadline:
            return False
        row.note = "skipped: --tune-budget-s spent"
        self.rows.append(row)
        return True

    def record(self, row: TuneRow) -> None:
        self.rows.append(row)
        self.run.log(f"  tune  {row.kernel:<7} {row.shape:<14} {row.config:<22}{' *' if row.default else '  '} "
                     f"{_f(row.us, '.1f'):>9} us {_f(row.rate, '.1f'):>8} {_f(row.score, '.2f'):>7}  "
                     f"rel {_f(row.rel, '.1e')} {row.note}")

    def check_and_time(self, row: TuneRow, fn, out: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
        """Run `fn` once, compare `out` with `ref`, then time it into `row`.
        False (and the row recorded) when the config fails to run."""
        try:
            fn()
            self.run.sync()
            row.rel = _rel(out, ref)
            row.us = self.run.bench(fn) * 1e3
        except Exception as e:  # noqa: BLE001 - a config that fails is a row
            row.note = f"error: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
            self.record(row)
            if "CUDA" in str(e):
                raise  # the context is gone: the runner stops touching the GPU
            return False
        if not (row.rel is not None and row.rel <= tol):
            row.note = "WRONG OUTPUT"
        return True

    # decode ---------------------------------------------------------------

    def decode(self, shapes: list[tuple[int, int]], split_counts: list[int]) -> None:
        from pdserve.kernels import configs
        from pdserve.kernels.triton_decode import paged_decode_attention

        r, p = self.run, self.run.p
        scale = p.head_dim ** -0.5
        default = configs.decode_config(p.head_dim, p.dtype)
        sweep = list(dict.fromkeys([default, *configs.DECODE_SWEEP]))
        for b, ctx in shapes:
            shape = f"b={b} ctx={ctx}"
            table, kc, vc = r.paged([ctx] * b)
            q = r.randn(b, p.heads, p.head_dim)
            seq_lens, qsl = r.seq_tensors([ctx] * b, [1] * b)
            ref = r.attn_ref64(q, kc, vc, table, [ctx] * b, [1] * b, scale)
            moved = b * ctx * p.kv_heads * p.head_dim * kc.element_size() * 2 + 2 * q.numel() * q.element_size()
            variants = [(cfg, None) for cfg in sweep]
            if b * p.kv_heads < 132 * 2:  # few programs: the split count matters most
                variants += [(default, s) for s in split_counts]
            for cfg, splits in variants:
                label = cfg.label() + ("" if splits is None else f" splits={splits}")
                row = TuneRow("decode", shape, label, default=cfg == default and splits is None)
                if self.out_of_time(row):
                    continue
                out = torch.full_like(q, float("nan"))
                fn = lambda c=cfg, s=splits: paged_decode_attention(  # noqa: E731
                    q, kc, vc, table, seq_lens, qsl, scale, 1, num_splits=s, out=out, config=c)
                if not self.check_and_time(row, fn, out, ref, p.rel_tol):
                    continue
                row.rate = moved / (row.us * 1e-6) / 1e9
                row.score = r.pct_bw(row.rate)
                self.record(row)
            del table, kc, vc, q, ref
            _free(p.device)

    # prefill --------------------------------------------------------------

    def prefill(self, lengths: list[int]) -> None:
        from pdserve.kernels import configs
        from pdserve.kernels.triton_prefill import device_arch, prefill_attention

        r, p = self.run, self.run.p
        scale = p.head_dim ** -0.5
        group_pad = 1 << max(0, (p.heads // p.kv_heads - 1).bit_length())
        for s in lengths:
            shape = f"1x{s}"
            default = configs.prefill_config(group_pad, p.head_dim, s, p.dtype, device_arch(r.p.device))
            sweep = list(dict.fromkeys([default, *configs.PREFILL_SWEEP]))
            table, kc, vc = r.paged([s], fill=False)
            q = r.randn(s, p.heads, p.head_dim)
            k = r.randn(s, p.kv_heads, p.head_dim)
            v = r.randn(s, p.kv_heads, p.head_dim)
            r.write_cache(k, v, kc, vc, r.slots(table, [s], [s]))
            seq_lens, qsl = r.seq_tensors([s], [s])
            qs = q.view(1, s, p.heads, p.head_dim).transpose(1, 2).contiguous()
            ks = k.view(1, s, p.kv_heads, p.head_dim).transpose(1, 2).contiguous()
            vs = v.view(1, s, p.kv_heads, p.head_dim).transpose(1, 2).contiguous()
            sdpa, sdpa_name = r.sdpa_fn(qs, ks, vs, scale, "flash")
            ref = sdpa().transpose(1, 2).reshape(s, p.heads, p.head_dim).double()
            flops = 2 * s * s * p.heads * p.head_dim
            timed: list[TuneRow] = []
            for cfg in sweep:
                row = TuneRow("prefill", shape, cfg.label(), default=cfg == default)
                if self.out_of_time(row):
                    continue
                out = torch.full_like(q, float("nan"))
                fn = lambda c=cfg: prefill_attention(q, kc, vc, table, seq_lens, qsl, scale, s, out=out, config=c)  # noqa: E731
                if not self.check_and_time(row, fn, out, ref, 2 * p.rel_tol):  # bf16 vs bf16
                    continue
                row.rate = flops / (row.us * 1e-6) / 1e12
                timed.append(row)
                self.record(row)
            ref_ms = r.bench(sdpa)  # after the configs, on the same warm card
            for row in timed:
                row.score = ref_ms * 1e3 / row.us
                row.note = (row.note + f" {sdpa_name} {ref_ms * 1e3:.0f} us").strip()
            del table, kc, vc, q, k, v, qs, ks, vs, ref
            _free(p.device)

    # report -------------------------------------------------------------

    def table(self) -> list[str]:
        lines = ["", "tuning sweep (--tune): configs per shape, fastest first; * = current default; "
                 "score = % of copy bandwidth (decode) or x SDPA flash (prefill)"]
        lines.append(f"{'kernel':<8} {'shape':<14} {'config':<24} {'us':>9} {'rate':>8} {'score':>7} {'rel':>8}  note")
        groups: dict[tuple[str, str], list[TuneRow]] = {}
        for row in self.rows:
            groups.setdefault((row.kernel, row.shape), []).append(row)
        for (kernel, shape), rows in groups.items():
            for row in sorted(rows, key=lambda x: math.inf if x.us is None or "WRONG" in x.note else x.us):
                lines.append(f"{kernel:<8} {shape:<14} {row.config + (' *' if row.default else ''):<24} "
                             f"{_f(row.us, '.1f'):>9} {_f(row.rate, '.1f'):>8} {_f(row.score, '.2f'):>7} "
                             f"{_f(row.rel, '.1e'):>8}  {row.note}")
            lines.extend(self._verdict(kernel, shape, rows))
        return lines

    def _verdict(self, kernel: str, shape: str, rows: list[TuneRow]) -> list[str]:
        good = [x for x in rows if x.us is not None and "WRONG" not in x.note]
        default = next((x for x in good if x.default), None)
        if not good or default is None:
            return [f"  -> {kernel} {shape}: no verdict (default not timed)"]
        best = min(good, key=lambda x: x.us)
        if best is default:
            return [f"  -> {kernel} {shape}: the default is fastest"]
        return [f"  -> {kernel} {shape}: {best.config} is {default.us / best.us:.2f}x the default's speed"]

    def to_json(self) -> list[dict]:
        return [asdict(x) for x in self.rows]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.double()
    if not bool(torch.isfinite(o).all()):
        return math.inf
    return float((o - ref).norm() / ref.norm().clamp_min(1e-300))


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def run_sweep(sweep: Sweep, dry: bool) -> Sweep:
    """The sweep the bars need: decode at the bar shape and a small batch, prefill at 4k and 16k."""
    runner, p = sweep.run, sweep.run.p
    if dry:  # one decode shape: a second runs the same loop, and each config costs seconds interpreted
        decode_shapes, splits = [p.bar_decode], [2, 4]
        lengths = [max(s for _, s in p.prefill_shapes)]
    else:
        decode_shapes, splits, lengths = [(64, 4096), (1, 16384), (8, 4096)], [8, 16, 32, 64], [4096, 16384]
    runner.log("== tune: decode")
    sweep.decode(decode_shapes, splits)
    runner.log("== tune: prefill")
    sweep.prefill(lengths)
    return sweep
