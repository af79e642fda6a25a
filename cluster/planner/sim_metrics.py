"""A simulated run's numbers, defined exactly as `pdserve bench` defines them.

Each simulated request becomes the bench's own `RequestRecord` (TTFT, E2E, the
gaps between token chunks), so percentiles, throughput and SLO attainment come
from the bench's `summarize` and `SLO.met_by`: a simulated and a measured run
are compared number for number. `attainment` is the fast path a rate search
calls many times; `goodput_rate` is DistServe's goodput by bisection.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from pdserve.cluster.bench.client import RequestRecord
from pdserve.cluster.bench.metrics import SLO, Summary, summarize
from pdserve.cluster.bench.sweep import DISTSERVE_TARGET
from pdserve.cluster.planner.sim_engine import Track
from pdserve.cluster.planner.simulator import SimResult


class Simulated(TypedDict):
    """What the simulator saw of a run, beside the bench's numbers."""

    cluster: str  # the configuration's label
    plans: dict[str, int]  # requests run under each plan
    preemptions: int
    worker_busy_s: dict[str, float]  # worker -> seconds it was computing
    prefix_hit_rate: float  # cached / prompt tokens of the finished requests
    events: int


class SimSummary(Summary):
    simulated: Simulated


def record(track: Track) -> RequestRecord:
    """One simulated request as the bench would have measured it."""
    r = track.req
    rec = RequestRecord(r.index, r.prompt_len, r.output_len, scheduled=r.arrival, sent=r.arrival)
    if track.rejected is not None:
        rec.error = track.rejected
        return rec
    if track.done is None or track.first is None:
        rec.error = "did not finish (simulated: e.g. a prompt larger than the KV pool)"
        return rec
    times = track.chunk_times()
    rec.success = True
    rec.ttft = track.first - r.arrival
    rec.e2e = track.done - r.arrival
    rec.itl = np.diff(times).tolist()
    rec.chunks = len(times)
    rec.output_tokens = r.output_len
    rec.prompt_tokens = r.prompt_len
    rec.usage_reported = True
    return rec


def records(result: SimResult) -> list[RequestRecord]:
    return [record(t) for t in result.tracks]


def summary(result: SimResult, slo: SLO | None = None) -> SimSummary:
    """The bench's summary of the simulated run (seconds; `ttft_s`, `tpot_s`, `itl_s`, ... with
    p50/p90/p99; `goodput` with SLO attainment when `slo` is given), plus what the simulator saw."""
    out = summarize(records(result), result.duration, slo)
    prompt = sum(t.req.prompt_len for t in result.tracks if t.done is not None)
    return {**out, "simulated": {"cluster": result.cluster.label, "plans": dict(result.plans),
                                 "preemptions": result.preemptions, "worker_busy_s": dict(result.busy_s),
                                 "prefix_hit_rate": sum(t.cached_tokens for t in result.tracks if t.done is not None)
                                 / prompt if prompt else 0.0, "events": result.events}}


@dataclass(frozen=True)
class Latencies:
    """Per-request TTFT, TPOT and E2E arrays (NaN where undefined or failed): the fast path."""

    ttft: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray
    ok: np.ndarray  # finished

    @classmethod
    def of(cls, result: SimResult) -> Latencies:
        n = len(result.tracks)
        ttft, tpot, e2e = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
        ok = np.zeros(n, dtype=bool)
        for i, t in enumerate(result.tracks):
            if t.done is None or t.first is None or t.rejected is not None:
                continue
            ok[i] = True
            ttft[i] = t.first - t.req.arrival
            e2e[i] = t.done - t.req.arrival
            if t.req.output_len > 1:
                tpot[i] = (t.done - t.first) / (t.req.output_len - 1)
        return cls(ttft, tpot, e2e, ok)

    def percentile(self, which: str, p: float) -> float | None:
        a = getattr(self, which)
        a = a[~np.isnan(a)]
        return float(np.percentile(a, p)) if len(a) else None

    def attainment(self, slo: SLO) -> float:
        """Share of all requests meeting every SLO (SLO.met_by's rule: a failed one meets none;
        one output token meets any TPOT SLO)."""
        if not len(self.ok):
            return 0.0
        met = self.ok.copy()
        if slo.ttft is not None:
            met &= self.ttft <= slo.ttft
        if slo.tpot is not None:
            met &= np.isnan(self.tpot) | (self.tpot <= slo.tpot)
        if slo.e2e is not None:
            met &= self.e2e <= slo.e2e
        return float(met.sum() / len(met))


@dataclass(frozen=True)
class GoodputSearch:
    rate: float | None  # the highest rate found with attainment >= target (None: not even the lowest)
    points: tuple[tuple[float, float], ...]  # (rate, attainment) for every rate simulated
    bounded: bool  # False when even the highest rate tried met the target (rate is a lower bound)


def goodput_rate(attainment_at: Callable[[float], float], start: float, target: float = DISTSERVE_TARGET,
                 rel_tol: float = 0.02, max_doublings: int = 16, max_halvings: int = 16) -> GoodputSearch:
    """DistServe's goodput: the highest request rate whose attainment is >= `target`, found by
    doubling/halving from `start` to bracket it and bisecting to `rel_tol` (attainment is taken
    to fall with rate, as it does once queues build)."""
    if not (start > 0 and math.isfinite(start)):
        raise ValueError(f"goodput search: start rate must be finite and > 0, got {start}")
    points: list[tuple[float, float]] = []

    def at(rate: float) -> float:
        a = attainment_at(rate)
        points.append((rate, a))
        return a

    lo, hi = 0.0, math.inf
    if at(start) >= target:
        lo = start
        for _ in range(max_doublings):
            r = lo * 2
            if at(r) >= target:
                lo = r
            else:
                hi = r
                break
    else:
        hi = start
        for _ in range(max_halvings):
            r = hi / 2
            if at(r) >= target:
                lo = r
                break
            hi = r
    if lo == 0.0:
        return GoodputSearch(None, tuple(points), True)
    if math.isinf(hi):
        return GoodputSearch(lo, tuple(points), False)
    for _ in range(64):  # bisection to rel_tol: bounded far below 64 halvings
        if hi - lo <= rel_tol * lo:
            break
        mid = (lo + hi) / 2
        if at(mid) >= target:
            lo = mid
        else:
            hi = mid
    return GoodputSearch(lo, tuple(points), True)
