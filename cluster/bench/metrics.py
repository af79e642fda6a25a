"""Records -> the numbers a benchmark reports. Pure functions, no I/O.

Definitions (shared/design/PERFORMANCE.md, vLLM's benchmark_serving):
- TTFT: request sent -> first token chunk.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request; undefined for one
  output token (such a request meets any TPOT SLO, as in vLLM and DistServe).
- ITL: gaps between consecutive token chunks, pooled over all requests. One
  chunk carrying k tokens (speculative decoding) is ONE gap, not k: ITL is per
  chunk, TPOT is per token.
- E2E: request sent -> last token chunk.
- Percentiles: numpy's default (linear interpolation).
- Throughputs: successful requests' totals / run duration (first send -> last reply).
- Goodput: successful requests meeting every given SLO (value <= SLO,
  inclusive), per second of run. SLO attainment: the share of all requests
  that did so; a failed request misses every SLO.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from .client import RequestRecord

PERCENTILES = (50, 90, 99)

# mean, median, std, min, max and p50/p90/p99 (PERCENTILES) of a latency; None when nothing was measured.
Distribution = dict[str, float | None]


class GoodputSummary(TypedDict):
    """The SLO part of a run's summary."""

    slo_s: dict[str, float]  # the targets given (ttft, tpot, e2e), seconds
    good_requests: int  # successful requests that met every target
    request_goodput: float | None  # good requests per second of run
    attainment: float | None  # good requests / all requests
    attainment_by_slo: dict[str, float | None]  # the same share per target


class Summary(TypedDict):
    """One run's numbers (`summarize`): what `pdserve bench` prints and its JSON keeps."""

    duration_s: float
    requests: int
    completed: int
    failed: int
    failure_reasons: dict[str, int]  # reason -> requests, most common first
    output_len_mismatch: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float | None
    input_token_throughput: float | None
    output_token_throughput: float | None
    total_token_throughput: float | None
    mean_concurrency: float | None
    ttft_s: Distribution
    tpot_s: Distribution
    itl_s: Distribution
    e2e_s: Distribution
    goodput: GoodputSummary | None  # None without SLOs


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds; None = not constrained."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot", "e2e"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"goodput: {name} SLO must be > 0, got {v}")
        if self.ttft is None and self.tpot is None and self.e2e is None:
            raise ValueError("goodput: give at least one of ttft:MS tpot:MS e2e:MS")

    @classmethod
    def parse(cls, items: list[str]) -> SLO:
        """['ttft:500', 'tpot:50'] (milliseconds, vLLM's --goodput syntax)."""
        vals: dict[str, float] = {}
        for item in items:
            key, sep, ms = item.partition(":")
            key = {"e2el": "e2e"}.get(key.strip().lower(), key.strip().lower())
            if not sep or key not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"goodput: expected ttft:MS, tpot:MS or e2e:MS, got {item!r}")
            try:
                vals[key] = float(ms) / 1000.0
            except ValueError:
                raise ValueError(f"goodput: {item!r}: {ms!r} is not a number of milliseconds") from None
        return cls(**vals)

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in (("ttft", self.ttft), ("tpot", self.tpot), ("e2e", self.e2e)) if v is not None}

    def met_by(self, rec: RequestRecord, which: str | None = None) -> bool:
        """Does `rec` meet this SLO (all given targets, or only `which`)?"""
        if not rec.success:
            return False
        values = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2e": rec.e2e}
        for key, limit in self.as_dict().items():
            if which is not None and key != which:
                continue
            v = values[key]
            if v is None or v > limit:
                return False
        return True


def distribution(values: list[float]) -> Distribution:
    """mean, std, min, max, median and the PERCENTILES of `values` (None when empty)."""
    keys = ["mean", "median", "std", "min", "max", *(f"p{p}" for p in PERCENTILES)]
    if not values:
        return dict.fromkeys(keys)
    a = np.asarray(values, dtype=float)
    out: Distribution = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
                         "min": float(a.min()), "max": float(a.max())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(a, p))
    return out


def failure_reasons(records: list[RequestRecord]) -> dict[str, int]:
    return dict(Counter(r.error or "unknown" for r in records if not r.success).most_common())


def goodput(records: list[RequestRecord], duration: float, slo: SLO) -> GoodputSummary:
    good = sum(slo.met_by(r) for r in records)
    n = len(records)
    per_slo = {k: (sum(slo.met_by(r, k) for r in records) / n if n else None) for k in slo.as_dict()}
    return {"slo_s": slo.as_dict(), "good_requests": good,
            "request_goodput": good / duration if duration > 0 else None,
            "attainment": good / n if n else None, "attainment_by_slo": per_slo}


def summarize(records: list[RequestRecord], duration: float, slo: SLO | None = None) -> Summary:
    """The summary of one run; times in seconds, rates per second."""
    ok = [r for r in records if r.success]
    tin = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok)
    tout = sum(r.output_tokens for r in ok)

    def rate(x: float) -> float | None:
        return x / duration if duration > 0 else None

    return {
        "duration_s": duration,
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "failure_reasons": failure_reasons(records),
        # asked for N output tokens, got another count (EOS honoured, or the server capped it)
        "output_len_mismatch": sum(r.output_tokens != r.output_len for r in ok),
        "total_input_tokens": tin,
        "total_output_tokens": tout,
        "request_throughput": rate(len(ok)),
        "input_token_throughput": rate(tin),
        "output_token_throughput": rate(tout),
        "total_token_throughput": rate(tin + tout),
        "mean_concurrency": rate(sum(r.e2e or 0.0 for r in ok)),  # Little's law
        "ttft_s": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": distribution([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": distribution([g for r in ok for g in r.itl]),
        "e2e_s": distribution([r.e2e for r in ok if r.e2e is not None]),
        "goodput": goodput(records, duration, slo) if slo is not None else None,
    }
