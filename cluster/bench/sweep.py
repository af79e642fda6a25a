"""The attainment curve of a rate sweep and DistServe's goodput: the highest
request rate at which at least `target` (90%) of requests meet the SLOs.

As in DistServe's `find_intersection`, the curve is walked in increasing rate
and the first drop below the target is located; the rate is then linearly
interpolated between the last point at or above the target and the first one
below. When no measured rate falls below the target, the answer is only a
lower bound: the highest measured rate ('highest_measured'). When even the
lowest rate misses it, there is no answer ('below_lowest').
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

DISTSERVE_TARGET = 0.9


class GoodputMethod(str, Enum):
    INTERPOLATED = "interpolated"
    HIGHEST_MEASURED = "highest_measured"
    BELOW_LOWEST = "below_lowest"


@dataclass(frozen=True)
class DistServeGoodput:
    rate: float | None  # requests/s
    method: GoodputMethod
    target: float


def parse_rates(text: str) -> list[float]:
    """'1,2,4' -> [1.0, 2.0, 4.0], increasing, finite and positive."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"sweep: expected comma-separated rates, got {text!r}") from None
    if not rates or any(not (0 < r < float("inf")) for r in rates):
        raise ValueError(f"sweep: rates must be finite and > 0, got {text!r}")
    return sorted(set(rates))


def distserve_goodput(rates: list[float], attainments: list[float],
                      target: float = DISTSERVE_TARGET) -> DistServeGoodput:
    if len(rates) != len(attainments) or not rates:
        raise ValueError("sweep: need one attainment per rate, and at least one rate")
    pts = sorted(zip(rates, attainments))
    if pts[0][1] < target:
        return DistServeGoodput(None, GoodputMethod.BELOW_LOWEST, target)
    for (r0, a0), (r1, a1) in zip(pts, pts[1:]):
        if a1 < target:  # a0 >= target here: the first crossing
            rate = r0 + (a0 - target) * (r1 - r0) / (a0 - a1)
            return DistServeGoodput(rate, GoodputMethod.INTERPOLATED, target)
    return DistServeGoodput(pts[-1][0], GoodputMethod.HIGHEST_MEASURED, target)
