"""PNG plots: latency CDFs with the SLO marked, and attainment vs request rate.

matplotlib is imported here only, on the Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .sweep import DistServeGoodput


def _pyplot() -> Any:  # matplotlib.pyplot (untyped)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdf(path: Path, name: str, series: dict[str, list[float]], slo_s: float | None,
             unit: str = "successful requests") -> Path:
    """Empirical CDF of each series (seconds, drawn in ms); a vertical line at the SLO."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for label, values in series.items():
        if not values:
            continue
        x = np.sort(np.asarray(values)) * 1000
        ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=label)
    if slo_s is not None:
        ax.axvline(slo_s * 1000, color="red", linestyle="--", label=f"SLO {slo_s * 1000:g} ms")
    ax.set_xlabel(f"{name} (ms)")
    ax.set_ylabel(f"fraction of {unit}")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{name} CDF")
    return _save(plt, fig, ax, path)


def plot_attainment(path: Path, rates: list[float], attainment: list[float],
                    per_slo: dict[str, list[float | None]], best: DistServeGoodput) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot(rates, [a * 100 for a in attainment], "o-", label="all SLOs")
    for k, vals in per_slo.items():
        pts = [(r, v * 100) for r, v in zip(rates, vals) if v is not None]
        if pts:
            ax.plot(*zip(*pts), ".--", alpha=0.6, label=f"{k} only")
    ax.axhline(best.target * 100, color="red", linestyle=":", label=f"{best.target:.0%} target")
    if best.rate is not None:
        ax.axvline(best.rate, color="green", linestyle="--",
                   label=f"goodput {best.rate:.3g} req/s ({best.method.value})")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 102)
    return _save(plt, fig, ax, path)


def _save(plt: Any, fig: Any, ax: Any, path: Path) -> Path:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
