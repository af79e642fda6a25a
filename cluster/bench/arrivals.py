"""When requests are sent: a renewal process of gamma inter-arrival gaps.

Gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)): the mean gap is
1/rate whatever the shape, and the coefficient of variation is
1/sqrt(burstiness). burstiness=1 is exponential gaps, i.e. Poisson arrivals;
below 1 burstier, above 1 more regular (the convention of vLLM's
`--burstiness` and AIPerf's `--arrival-smoothness`).

Unlike vLLM we do not rescale the draws so the last arrival lands at N/rate:
that would make the gaps of a run depend on each other, and the seed already
makes runs reproducible.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start of the run, non-decreasing, first at 0.

    rate=inf sends everything at once (offsets all 0); burstiness=inf is evenly spaced
    arrivals, 1/rate apart (vLLM's limit of ever more regular gaps).
    """
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"request rate: must be > 0 (or inf), got {rate}")
    if not burstiness > 0:  # (NaN too)
        raise ValueError(f"burstiness: must be > 0 (or inf), got {burstiness}")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):  # numpy's gamma of an infinite shape is NaN: every request went at once
        return [i / rate for i in range(n)]
    rng = np.random.default_rng(seed)
    # The first request goes at t=0; the n-1 gaps after it are the process.
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def rescale_to_rate(offsets: list[float], rate: float) -> list[float]:
    """Stretch or squeeze `offsets` (e.g. a trace's timestamps) so their mean rate is `rate`.

    The mean rate of n arrivals over a span S is (n-1)/S; the shape of the
    trace (its bursts and lulls) is kept.
    """
    if len(offsets) < 2 or math.isinf(rate):
        return [0.0] * len(offsets) if math.isinf(rate) else list(offsets)
    t0 = offsets[0]
    span = offsets[-1] - t0
    if span <= 0:
        return [0.0] * len(offsets)
    factor = (len(offsets) - 1) / rate / span
    return [(t - t0) * factor for t in offsets]
