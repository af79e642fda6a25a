"""The cost models' grid correction (cost_grid.py): exact at the profile's points where the
fitted shapes are not, between them close to the hardware's own curve, never cheaper for
more work along a measured column, and what the simulator's steps then take."""

from __future__ import annotations

import dataclasses

import pytest
from sim_factories import synthetic_profile, unique_requests

from pdserve.cluster.planner.profile import DecodePoint, PrefillPoint, Profile
from pdserve.cluster.planner.simulator import ClusterShape, engine_settings, simulate

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (128, 512, 2048)


def knee(batch: float, context: float) -> float:
    """A CPU decode step's shape (SmolLM2's profile): every row up to 8 shares the weights'
    read at 6 ms a row, past that 1.5 ms a row, plus the KV read. No line in batch fits it."""
    return 0.030 + 0.006 * min(batch, 8) + 0.0015 * max(0.0, batch - 8) + 2e-8 * batch * context


def knee_profile() -> Profile:
    pts = [DecodePoint(b, c, knee(b, c)) for b in BATCHES for c in CONTEXTS]
    return dataclasses.replace(synthetic_profile(), decode=tuple(pts))


def test_the_fitted_shape_alone_misses_a_knee_the_corrected_model_hits_every_point() -> None:
    p = knee_profile()
    costs = p.costs()
    shape_worst, where = costs.fitted.fit_errors(p)["decode"]
    assert abs(shape_worst) > 0.15, where  # the case the correction is for
    for d in p.decode:
        assert costs.decode_s(d.batch, d.context) == pytest.approx(d.seconds, rel=1e-9)
    worst, _ = costs.fit_errors(p)["decode"]
    assert abs(worst) < 1e-9


@pytest.mark.parametrize("batch,context", [(3, 300), (6, 128), (12, 700), (24, 1500), (48, 256), (96, 1024)])
def test_between_the_points_the_corrected_step_follows_the_hardware_curve(batch: int, context: int) -> None:
    costs = knee_profile().costs()
    truth = knee(batch, context)
    assert costs.decode_s(batch, context) == pytest.approx(truth, rel=0.06)
    assert abs(costs.fitted.decode_s(batch, context) / truth - 1) > abs(costs.decode_s(batch, context) / truth - 1)


@pytest.mark.parametrize("context", [128, 300, 2048, 4000])
def test_more_rows_never_cost_less(context: int) -> None:
    costs = knee_profile().costs()
    steps = [costs.decode_s(b, context) for b in range(1, 200)]
    assert all(b >= a - 1e-12 for a, b in zip(steps, steps[1:]))


def test_beyond_the_grid_the_edge_ratio_scales_the_fit() -> None:
    p = knee_profile()
    costs = p.costs()
    edge = costs.decode_s(128, 2048) / costs.fitted.decode_s(128, 2048)
    assert costs.decode_s(256, 8192) == pytest.approx(costs.fitted.decode_s(256, 8192) * edge, rel=1e-9)


def test_a_prefill_with_a_cached_prefix_takes_its_own_column_ratio() -> None:
    """Cached prompts run slower per token than the quadratic shape says (a stand-in for
    attention over a long cached prefix): each measured (new, cached) point exact."""
    base = synthetic_profile()
    pts = [PrefillPoint(q.new_tokens, q.cached_tokens, q.seconds * (1.3 if q.cached_tokens else 1.0))
           for q in base.prefill] + [PrefillPoint(128, 512, 0.0)]
    fit_only = dataclasses.replace(base, prefill=tuple(p for p in pts if p.seconds > 0)).costs().fitted
    pts[-1] = PrefillPoint(128, 512, fit_only.prefill_s(128, 512) * 1.5)
    p = dataclasses.replace(base, prefill=tuple(pts))
    costs = p.costs()
    for q in p.prefill:
        assert costs.prefill_s(q.new_tokens, q.cached_tokens) == pytest.approx(q.seconds, rel=0.02)
    assert costs.prefill_s(1024, 0) == pytest.approx(base.costs().prefill_s(1024, 0), rel=1e-9)


def test_the_simulated_decode_takes_the_measured_steps() -> None:
    """8 equal requests at once on one colocated worker: after the one prefill step, their
    decode steps take what the knee says at batch 8, not what a line through it says."""
    p = knee_profile()
    costs = dataclasses.replace(p.costs(), host=None)
    batch, prompt, out = 8, 512, 48
    e = engine_settings(p, max_num_batched_tokens=batch * prompt, num_kv_blocks=4096)
    r = simulate(costs, e, ClusterShape.colocated(1), unique_requests([0.0] * batch, prompt, out))
    first = {t.first for t in r.tracks}
    assert len(first) == 1
    decoding = max(t.done for t in r.tracks if t.done is not None) - first.pop()
    truth = sum(knee(batch, prompt + j) for j in range(1, out))
    assert decoding == pytest.approx(truth, rel=0.02)
    shape_only = sum(costs.fitted.decode_s(batch, prompt + j) for j in range(1, out))
    assert abs(shape_only / truth - 1) > 0.1
