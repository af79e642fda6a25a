"""Arrival processes: gamma gaps with mean 1/rate and CV 1/sqrt(burstiness), seeded."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.cluster.bench.arrivals import arrival_offsets, rescale_to_rate


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
@pytest.mark.parametrize("rate", [2.0, 50.0])
def test_gaps_have_mean_one_over_rate_and_cv_one_over_sqrt_burstiness(rate: float, burstiness: float) -> None:
    offs = arrival_offsets(40_000, rate, burstiness, seed=1)
    gaps = np.diff(offs)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.04)


def test_poisson_counts_per_window_have_variance_equal_to_mean() -> None:
    # burstiness 1 is a Poisson process: counts in fixed windows are Poisson (var == mean)
    offs = np.asarray(arrival_offsets(50_000, 10.0, 1.0, seed=3))
    counts = np.bincount((offs // 1.0).astype(int))[:-1]
    assert counts.mean() == pytest.approx(10.0, rel=0.03)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.08)


def test_first_request_at_zero_and_offsets_non_decreasing() -> None:
    offs = arrival_offsets(100, 5.0, 0.5, seed=0)
    assert offs[0] == 0.0
    assert all(b >= a for a, b in zip(offs, offs[1:]))


def test_seeded() -> None:
    assert arrival_offsets(50, 3.0, 1.0, seed=7) == arrival_offsets(50, 3.0, 1.0, seed=7)
    assert arrival_offsets(50, 3.0, 1.0, seed=7) != arrival_offsets(50, 3.0, 1.0, seed=8)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets(5, math.inf) == [0.0] * 5


@pytest.mark.parametrize("rate,burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_bad_parameters_are_value_errors(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        arrival_offsets(10, rate, burstiness)


def test_rescale_keeps_the_shape_and_sets_the_mean_rate() -> None:
    ts = [10.0, 10.5, 13.0, 14.0]  # gaps 0.5, 2.5, 1.0: mean rate 3 / 4 s
    out = rescale_to_rate(ts, 3.0)  # -> span 1 s
    assert out[0] == 0.0
    assert out[-1] == pytest.approx(1.0)
    assert np.diff(out) == pytest.approx(np.diff(ts) / 4.0)


def test_infinite_burstiness_spaces_requests_evenly() -> None:
    """vLLM's --burstiness inf: gaps of exactly 1/rate. numpy's gamma of an infinite shape is NaN,
    and every request went out at t=0 under a table that said 2 req/s."""
    assert arrival_offsets(5, 2.0, burstiness=math.inf) == [0.0, 0.5, 1.0, 1.5, 2.0]
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(5, 2.0, burstiness=math.nan)


def test_a_plan_with_send_times_that_are_no_numbers_is_refused() -> None:
    from pdserve.cluster.bench.runner import Plan

    with pytest.raises(ValueError, match="send times"):
        Plan("http://127.0.0.1:1/v1/completions", [{"prompt": "x"}] * 2, [1, 1], [1, 1], [0.0, math.nan],  # type: ignore[list-item]
             None, 10.0)
