"""The printed summary table and the result JSON (times in seconds there, ms in the table)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TextIO, TypedDict

from .client import RequestRecord
from .metrics import Summary
from .sweep import DistServeGoodput

_LAT_COLS = ("mean", "median", "std", "min", "p90", "p99", "max")


class SweepPoint(TypedDict):
    """One rate of a sweep: a row of the sweep table and a point of the attainment curve."""

    request_rate: float
    attainment: float  # 0.0 where nothing was measured
    attainment_by_slo: dict[str, float | None]
    request_goodput: float | None
    completed: int
    failed: int
    interrupted: bool
    p99_ttft_s: float | None
    p99_tpot_s: float | None


class BestRate(TypedDict):
    rate: float | None  # requests/s
    method: str  # a GoodputMethod's value
    target_attainment: float


class SweepJson(TypedDict):
    points: list[SweepPoint]
    distserve_goodput: BestRate


class RunJson(TypedDict):
    request_rate: float | str  # "inf": all at once
    interrupted: bool
    summary: Summary
    requests: list[dict[str, object]]  # `record_dict` of each request


def record_dict(r: RequestRecord) -> dict[str, object]:
    """The record's fields by name (`asdict`), and its TPOT."""
    d: dict[str, object] = asdict(r)
    d["tpot"] = r.tpot
    return d


def run_dict(rate: float, interrupted: bool, summary: Summary, records: list[RequestRecord]) -> RunJson:
    return {"request_rate": _num(rate), "interrupted": interrupted, "summary": summary,
            "requests": [record_dict(r) for r in records]}


def sweep_dict(points: list[SweepPoint], best: DistServeGoodput) -> SweepJson:
    return {"points": points, "distserve_goodput": {"rate": best.rate, "method": best.method.value,
                                                   "target_attainment": best.target}}


def _num(x: float) -> float | str:
    return x if x != float("inf") else "inf"  # JSON has no infinity


def write_json(path: str | Path, config: Mapping[str, object], runs: list[RunJson], sweep: SweepJson | None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config, "runs": runs, "sweep": sweep}, indent=1, default=str) + "\n")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.2f}"


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def print_summary(title: str, s: Summary, out: TextIO) -> None:
    w = 40
    lines = [f"{' ' + title + ' ':=^72}",
             f"{'Successful requests:':<{w}}{s['completed']}",
             f"{'Failed requests:':<{w}}{s['failed']}"]
    lines += [f"  {n:>5} x {reason[:100]}" for reason, n in s["failure_reasons"].items()]
    if s["output_len_mismatch"]:
        lines.append(f"{'Output length != requested:':<{w}}{s['output_len_mismatch']} requests")
    lines += [f"{'Benchmark duration (s):':<{w}}{s['duration_s']:.2f}",
              f"{'Total input tokens:':<{w}}{s['total_input_tokens']}",
              f"{'Total output tokens:':<{w}}{s['total_output_tokens']}",
              f"{'Request throughput (req/s):':<{w}}{_f(s['request_throughput'])}",
              f"{'Input token throughput (tok/s):':<{w}}{_f(s['input_token_throughput'])}",
              f"{'Output token throughput (tok/s):':<{w}}{_f(s['output_token_throughput'])}",
              f"{'Total token throughput (tok/s):':<{w}}{_f(s['total_token_throughput'])}",
              f"{'Mean concurrency:':<{w}}{_f(s['mean_concurrency'])}"]
    g = s.get("goodput")
    if g:
        slo = " ".join(f"{k}<={v * 1000:g}ms" for k, v in g["slo_s"].items())
        per = ", ".join(f"{k} {v:.1%}" for k, v in g["attainment_by_slo"].items() if v is not None)
        lines += [f"{'Request goodput (req/s):':<{w}}{_f(g['request_goodput'])}  ({slo})",
                  f"{'SLO attainment:':<{w}}{_f(g['attainment'], '.1%')}  ({per})"]
    lines.append(f"{'latency (ms)':<12}" + "".join(f"{c:>10}" for c in _LAT_COLS))
    for name, dist in (("TTFT", s["ttft_s"]), ("TPOT", s["tpot_s"]), ("ITL", s["itl_s"]), ("E2E", s["e2e_s"])):
        lines.append(f"{name:<12}" + "".join(f"{_ms(dist[c]):>10}" for c in _LAT_COLS))
    out.write("\n".join(lines) + "\n")


def print_sweep(points: list[SweepPoint], best: DistServeGoodput, out: TextIO) -> None:
    lines = [f"{' rate sweep ':=^72}",
             f"{'rate/s':>8}{'attain':>9}{'goodput':>9}{'done':>6}{'fail':>6}{'p99 TTFT ms':>13}{'p99 TPOT ms':>13}"]
    for p in points:
        lines.append(f"{p['request_rate']:>8g}{_f(p['attainment'], '.1%'):>9}{_f(p['request_goodput']):>9}"
                     f"{p['completed']:>6}{p['failed']:>6}{_ms(p['p99_ttft_s']):>13}{_ms(p['p99_tpot_s']):>13}")
    if best.rate is None:
        lines.append(f"DistServe goodput: none (attainment < {best.target:.0%} already at the lowest rate)")
    else:
        how = {"interpolated": "interpolated between the measured rates around the crossing",
               "highest_measured": "the highest measured rate; attainment never fell below the target, so "
                                   "the true value is at least this"}[best.method.value]
        lines.append(f"DistServe goodput (highest rate with >= {best.target:.0%} attainment): "
                     f"{best.rate:.3g} req/s ({how})")
    out.write("\n".join(lines) + "\n")
