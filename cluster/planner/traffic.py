"""A window of observed traffic, read from the gateway's own Prometheus histograms.

The planner loop re-plans on what the gateway saw lately: how many requests
finished in the window (the rate), and the distribution of their prompt and
output lengths (the `pdserve:request_prompt_tokens` and
`pdserve:request_generation_tokens` histograms, one observation per finished
request), with the attainment of the SLOs over the same requests (the TTFT,
TPOT and E2E histograms). A window is the difference of two scrapes of the cumulative
bucket counts, exactly what Prometheus' `increase()` would see.

The simulator needs requests, not histograms: `synthetic_requests` draws
lengths from the window's buckets (uniform inside a bucket) and Poisson
arrivals at the window's rate. What a histogram cannot say, it does not
invent: prompts share no prefix (the planner under-counts what prefix caching
saves), and lengths inside a bucket are uniform, cut to max_model_len (every
request counted fit it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from prometheus_client import CollectorRegistry

from pdserve.cluster.planner.sim_workload import SimRequest

# The gateway's histograms (cluster/metrics.py).
PROMPT_TOKENS = "pdserve:request_prompt_tokens"
GENERATION_TOKENS = "pdserve:request_generation_tokens"
TTFT = "pdserve:time_to_first_token_seconds"
TPOT = "pdserve:time_per_output_token_seconds"
E2E = "pdserve:e2e_request_latency_seconds"
WATCHED = (PROMPT_TOKENS, GENERATION_TOKENS, TTFT, TPOT, E2E)

# Buckets: (upper bound, cumulative count), ascending, the last one +Inf.
Buckets = tuple[tuple[float, float], ...]


def read_histograms(registry: CollectorRegistry, names: tuple[str, ...] = WATCHED) -> dict[str, Buckets]:
    """The cumulative bucket counts of each named histogram now (absent ones: no entry)."""
    out: dict[str, Buckets] = {}
    for family in registry.collect():
        if family.name not in names or family.type != "histogram":
            continue
        rows = [(float(s.labels["le"]), float(s.value)) for s in family.samples if s.name.endswith("_bucket")]
        out[family.name] = tuple(sorted(rows))
    return out


def _delta(now: Buckets, before: Buckets | None) -> Buckets:
    if before is None:
        return now
    old = dict(before)
    return tuple((le, max(0.0, c - old.get(le, 0.0))) for le, c in now)


def _count(b: Buckets) -> float:
    return b[-1][1] if b else 0.0


def fraction_at_most(b: Buckets, limit: float) -> float | None:
    """Share of a window's observations <= `limit` (by the bucket at or below it: a lower
    bound when `limit` falls inside a bucket). None when the window has none."""
    total = _count(b)
    if total <= 0:
        return None
    below = max((c for le, c in b if le <= limit), default=0.0)
    return below / total


@dataclass(frozen=True)
class TrafficWindow:
    """What the gateway saw over `seconds`: per-request length histograms and latency ones."""

    seconds: float
    prompt_tokens: Buckets
    generation_tokens: Buckets
    ttft: Buckets
    tpot: Buckets
    e2e: Buckets = ()  # what an e2e SLO's observed share reads (empty: none observed)

    @property
    def requests(self) -> int:
        return int(_count(self.prompt_tokens))

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    def mean(self, which: str) -> float | None:
        """The mean of `prompt_tokens` or `generation_tokens` from the bucket midpoints."""
        b: Buckets = getattr(self, which)
        total = _count(b)
        if total <= 0:
            return None
        acc, lo, prev = 0.0, 0.0, 0.0
        for le, c in b:
            hi = le if math.isfinite(le) else max(lo * 2, 1.0)
            acc += (c - prev) * (lo + hi) / 2
            lo, prev = (le if math.isfinite(le) else lo), c
        return acc / total

    def synthetic_requests(self, n: int, block_size: int, seed: int = 0,
                           max_model_len: int | None = None) -> list[SimRequest]:
        """`n` requests like the window's: Poisson arrivals at its rate, lengths drawn
        from its buckets, no shared prefixes. With `max_model_len`, a drawn prompt + output
        past it is cut to fit (`_fit_model_len`): every request the window counted finished, so
        fit it, and a longer draw would be refused as too long in every split simulated."""
        if self.requests <= 0 or self.rate <= 0:
            raise ValueError("traffic window: no finished requests to plan on")
        rng = np.random.default_rng(seed)
        prompts = _draw(self.prompt_tokens, n, rng)
        outputs = _draw(self.generation_tokens, n, rng)
        if max_model_len is not None:
            prompts, outputs = _fit_model_len(prompts, outputs, max_model_len)
        gaps = rng.exponential(1.0 / self.rate, size=n)
        gaps[0] = 0.0
        arrivals = np.cumsum(gaps)
        out: list[SimRequest] = []
        for i in range(n):
            p = prompts[i]
            # Unshared prompts: every block is this request's own (ids no other request has).
            hashes = tuple((1 << 62) | (i << 24) | j for j in range(p // block_size))
            out.append(SimRequest(i, float(arrivals[i]), p, outputs[i], hashes, hashes[0] if hashes else None))
        return out


def _draw(b: Buckets, n: int, rng: np.random.Generator) -> list[int]:
    """`n` integers >= 1 distributed as the histogram: a bucket by its count, then uniform
    inside it (the +Inf bucket: up to twice the last finite bound)."""
    bounds: list[tuple[float, float, float]] = []  # (lo, hi, count)
    lo, prev = 0.0, 0.0
    for le, c in b:
        hi = le if math.isfinite(le) else max(2 * lo, lo + 1)
        if c - prev > 0:
            bounds.append((lo, hi, c - prev))
        lo, prev = hi, c
    if not bounds:
        raise ValueError("traffic window: an empty length histogram")
    weights = np.array([w for _, _, w in bounds])
    picks = rng.choice(len(bounds), size=n, p=weights / weights.sum())
    out: list[int] = []
    for k in picks:
        blo, bhi, _ = bounds[int(k)]
        out.append(max(1, int(math.ceil(rng.uniform(blo, bhi)))))
    return out


def _fit_model_len(prompts: list[int], outputs: list[int], max_model_len: int) -> tuple[list[int], list[int]]:
    """Each (prompt, output) cut to fit `max_model_len`: the prompt to leave one output
    token, then the output to what is left (the bucket's spread, not the request, went past it)."""
    fitted = [min(p, max_model_len - 1) for p in prompts]
    return fitted, [max(1, min(o, max_model_len - p)) for p, o in zip(fitted, outputs)]


class TrafficReader:
    """Windows from successive reads of a registry: each `take()` returns what changed since the last."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._last: Mapping[str, Buckets] | None = None
        self._last_t: float | None = None

    def take(self, now: float) -> TrafficWindow | None:
        """The window since the previous `take` (None on the first: it only sets the baseline)."""
        hist = read_histograms(self.registry)
        last, last_t = self._last, self._last_t
        self._last, self._last_t = hist, now
        if last is None or last_t is None:
            return None

        def d(name: str) -> Buckets:
            return _delta(hist.get(name, ()), last.get(name))

        return TrafficWindow(now - last_t, d(PROMPT_TOKENS), d(GENERATION_TOKENS), d(TTFT), d(TPOT), d(E2E))
