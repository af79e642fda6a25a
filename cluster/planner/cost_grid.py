"""The measured/fitted ratio over a profile's grid: what makes the cost models hit the points.

The fitted shapes (costs.py) extrapolate well but bend wrong inside the grid where the
hardware does not follow them. SmolLM2's decode step on a 2-core CPU grows 6.5 ms a row
from batch 4 to 8 and 2.1 ms a row from 8 to 16 (the weights' read is shared by every row
until the rows' own work takes over): a line through batches 1-128 put batch 8 at 60 ms
where 82.5 was measured, and the simulator, with steps 20-28% too short at the batches
serving runs at, predicted a 1P+1D decode worker at 2 req/s with a smaller batch and a
TPOT 30% low. The correction multiplies the fit by the ratio measured/fitted, interpolated
linearly in log(batch) and log(context) (a prefill: log(new tokens) and log(cached + 1)): exact at every
measured point, the fit's own shape between and beyond them (the ratio holds at the
grid's edge). A point the profile skipped (its KV did not fit) takes its column's
neighbours' ratio.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Ratio1D:
    """Ratio at sorted log-positions `xs`; `at(x)` interpolates, clamped at the ends."""

    xs: tuple[float, ...]
    ratios: tuple[float, ...]

    @classmethod
    def of(cls, points: Iterable[tuple[float, float, float]]) -> Ratio1D | None:
        """From (x, measured, fitted) triples (x > 0); None when no usable point."""
        by_x: dict[float, list[float]] = {}
        for x, measured, fitted in points:
            if x > 0 and measured > 0 and fitted > 0:
                by_x.setdefault(math.log(x), []).append(measured / fitted)
        if not by_x:
            return None
        xs = sorted(by_x)
        return cls(tuple(xs), tuple(float(np.mean(by_x[x])) for x in xs))

    def at(self, x: float) -> float:
        if len(self.xs) == 1 or x <= 0:
            return self.ratios[0]
        return float(np.interp(math.log(x), self.xs, self.ratios))


@dataclass(frozen=True)
class Ratio2D:
    """Ratio over (batch, context): one `Ratio1D` over batch per measured context, then
    linear in log(context) between those columns (clamped at the first and last)."""

    contexts: tuple[float, ...]  # log(context) of each column, sorted
    columns: tuple[Ratio1D, ...]

    @classmethod
    def of(cls, points: Iterable[tuple[int, int, float]], fitted: Callable[[int, int], float]) -> Ratio2D | None:
        """From (batch, context, measured seconds) and the fitted model; None without points."""
        by_ctx: dict[int, list[tuple[float, float, float]]] = {}
        for batch, context, seconds in points:
            by_ctx.setdefault(context, []).append((batch, seconds, fitted(batch, context)))
        cols = [(math.log(c), Ratio1D.of(pts)) for c, pts in sorted(by_ctx.items()) if c > 0]
        usable = [(x, col) for x, col in cols if col is not None]
        if not usable:
            return None
        return cls(tuple(x for x, _ in usable), tuple(col for _, col in usable))

    def at(self, batch: float, context: float) -> float:
        vals = [col.at(batch) for col in self.columns]
        if len(vals) == 1 or context <= 0:
            return vals[0]
        return float(np.interp(math.log(context), self.contexts, vals))
