"""The cost model's convex decode term, and a CPU host's cores shared with the KV handoff's
threads and the token streaming (costs.py `HostCPU`, simulator.py `_Cluster.charge`)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from sim_factories import synthetic_profile, unique_requests

from pdserve.cluster.planner.costs import DEFAULT_SERVING_CPU_PER_TOKEN_S, CostModel, HostCPU
from pdserve.cluster.planner.profile import DecodePoint, Profile
from pdserve.cluster.planner.sim_metrics import Latencies
from pdserve.cluster.planner.simulator import ClusterShape, engine_settings, simulate

SUPERLINEAR = (1e-3, 4e-5, 2e-7, 1e-12)  # a, per row, per KV token, per (KV token)^2


def superlinear_profile() -> Profile:
    a, b, c, q = SUPERLINEAR
    pts = [DecodePoint(bt, ctx, a + b * bt + c * bt * ctx + q * (bt * ctx) ** 2)
           for bt in (1, 4, 16, 64, 128) for ctx in (128, 512, 2032)]
    return dataclasses.replace(synthetic_profile(), decode=tuple(pts))


def test_the_decode_fit_captures_a_superlinear_point_set_as_float64_least_squares_does() -> None:
    p = superlinear_profile()
    costs = p.costs()
    # the oracle: float64 least squares on the same relative-error weighting, all four terms free
    x = np.array([[1.0, d.batch, d.batch * d.context, float(d.batch * d.context) ** 2] for d in p.decode])
    y = np.array([d.seconds for d in p.decode])
    oracle, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    fitted = np.array([*costs.decode_coef, costs.decode_quad])
    assert np.allclose(fitted, oracle, rtol=1e-6, atol=0)
    assert np.allclose(fitted, SUPERLINEAR, rtol=1e-6, atol=0)
    worst, _ = costs.fit_errors(p)["decode"]
    assert abs(worst) < 1e-6
    # the linear shape alone misses the biggest working set by far
    lin = np.linalg.lstsq(x[:, :3] / y[:, None], np.ones_like(y), rcond=None)[0]
    assert (x[-1, :3] @ lin) / y[-1] < 0.9


def test_linear_points_leave_the_convex_term_at_zero() -> None:
    costs = synthetic_profile().costs()
    assert costs.decode_quad == pytest.approx(0.0, abs=1e-18)


def test_a_decode_only_segment_with_the_convex_term_stays_within_its_exact_step_sum() -> None:
    p = superlinear_profile()
    costs = dataclasses.replace(p.costs(), host=None)
    batch, prompt, out = 64, 1024, 64
    e = engine_settings(p, max_num_batched_tokens=batch * prompt, num_kv_blocks=8192)  # one prefill step
    reqs = unique_requests([0.0] * batch, prompt, out)
    r = simulate(costs, e, ClusterShape.colocated(1), reqs)
    first = {t.first for t in r.tracks}
    assert len(first) == 1
    decoding = max(t.done for t in r.tracks if t.done is not None) - first.pop()
    exact = sum(costs.decode_s(batch, prompt + j) for j in range(1, out))  # the steps after the prefill's token
    assert costs.decode_quad * (batch * prompt) ** 2 > 0.1 * costs.decode_s(batch, prompt)  # the term matters
    assert exact <= decoding + 1e-12 and decoding <= exact * 1.01  # the secant: a convex model's steps a bit long


def cpu_costs(cores: int, per_token: float = 0.0, transfer_cpu: bool = True) -> CostModel:
    return dataclasses.replace(synthetic_profile().costs(), host=HostCPU(cores, 1, per_token, transfer_cpu))


def run(costs: CostModel, shape: ClusterShape, rate: float = 30.0, n: int = 300) -> Latencies:
    """Poisson arrivals (a queue forms at times: the prefill worker is then busy as it sends)."""
    p = synthetic_profile()
    arrivals = np.cumsum(np.random.default_rng(0).exponential(1 / rate, n)).tolist()
    reqs = unique_requests(arrivals, 2048, 16)
    r = simulate(costs, engine_settings(p), shape, reqs)
    assert all(t.done is not None for t in r.tracks)
    assert not any(r.blocks_held.values())
    return Latencies.of(r)


def test_a_costly_handoff_on_a_2_core_host_predicts_higher_ttft_and_tpot_than_a_free_link() -> None:
    shape = ClusterShape.disaggregated(1, 1)
    free = run(synthetic_profile().costs(), shape)
    costly = run(cpu_costs(2), shape)
    assert costly.percentile("ttft", 50) > free.percentile("ttft", 50)
    assert costly.percentile("tpot", 50) > free.percentile("tpot", 50) * 1.05
    # a host with cores to spare runs the handoff's threads there: the same as a free link
    spare = run(cpu_costs(4), shape)
    assert spare.percentile("ttft", 50) == pytest.approx(free.percentile("ttft", 50))
    assert spare.percentile("tpot", 90) == pytest.approx(free.percentile("tpot", 90))
    # and a host told its handoffs cost no CPU
    off = run(cpu_costs(2, transfer_cpu=False), shape)
    assert off.percentile("tpot", 90) == pytest.approx(free.percentile("tpot", 90))


def test_a_busy_host_charges_the_token_streaming_to_the_engines_an_idle_core_absorbs_it() -> None:
    shape = ClusterShape.colocated(2)
    free = run(synthetic_profile().costs(), shape)
    streamed = run(cpu_costs(2, per_token=1e-3), shape)
    assert streamed.percentile("tpot", 50) > free.percentile("tpot", 50) * 1.05
    idle_core = run(cpu_costs(3, per_token=1e-3), shape)
    assert idle_core.percentile("tpot", 50) == pytest.approx(free.percentile("tpot", 50))


def test_a_gpu_profile_or_one_without_cores_has_no_host_and_a_cpu_one_records_its_own() -> None:
    p = synthetic_profile()
    assert p.costs().host is None  # no core count recorded
    with_cores = dataclasses.replace(p, machine={"cores": 2})
    host = with_cores.costs().host
    assert host == HostCPU(2, p.engine.torch_threads, DEFAULT_SERVING_CPU_PER_TOKEN_S)
    gpu = dataclasses.replace(with_cores, engine=dataclasses.replace(p.engine, device="cuda"))
    assert gpu.costs().host is None
    own = dataclasses.replace(with_cores, serving_cpu_per_token_s=0.0001)
    again = Profile.from_json(json.loads(json.dumps(own.to_json())))
    assert again.costs().host == HostCPU(2, p.engine.torch_threads, 0.0001)
