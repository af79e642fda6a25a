"""The simulator against oracles: closed-form step sums, an M/D/1 queue, routing effects."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sim_factories import synthetic_profile, unique_requests

from pdserve.cluster.bench.arrivals import arrival_offsets
from pdserve.cluster.bench.config import BenchConfig
from pdserve.cluster.bench.metrics import SLO
from pdserve.cluster.bench.workloads import WorkloadKind
from pdserve.cluster.planner.sim_metrics import Latencies, goodput_rate, records, summary
from pdserve.cluster.planner.sim_workload import Workload
from pdserve.cluster.planner.simulator import ClusterShape, engine_settings, simulate
from pdserve.cluster.router.policy import RoutingPolicy


def decode_sum(costs, batch: int, context0: float, steps: int) -> float:
    """Seconds for `steps` decode steps of `batch` rows whose contexts start at `context0`."""
    return sum(costs.decode_s(batch, context0 + j) for j in range(steps))


def test_one_request_on_an_idle_disaggregated_cluster_costs_prefill_then_transfer_then_decode() -> None:
    p = synthetic_profile()
    c, e = p.costs(), engine_settings(p)
    prompt, out = 1000, 20
    r = simulate(c, e, ClusterShape.disaggregated(1, 1), unique_requests([0.5], prompt, out))
    tr = r.tracks[0]
    assert tr.plan == "handoff"
    ttft = c.prefill_s(prompt, 0) + c.transfer_s(prompt)
    assert tr.first - 0.5 == pytest.approx(ttft, rel=1e-12)
    # the first token came with the KV; the other out-1 come from decode steps of a batch of one
    assert tr.done - tr.first == pytest.approx(decode_sum(c, 1, prompt + 1, out - 1), rel=1e-9)
    rec = records(r)[0]
    assert rec.success and rec.tpot == pytest.approx((tr.done - tr.first) / (out - 1))
    assert len(rec.itl) == out - 1
    # the gateway's own time per request, when given, comes first
    late = simulate(c, e, ClusterShape.disaggregated(1, 1, dispatch_s=0.004), unique_requests([0.5], prompt, out))
    assert late.tracks[0].first - 0.5 == pytest.approx(0.004 + ttft, rel=1e-12)


def test_a_chunked_prefill_streams_its_kv_so_only_the_last_chunk_s_transfer_shows() -> None:
    p = synthetic_profile(max_num_batched_tokens=512)
    c, e = p.costs(), engine_settings(p)
    prompt = 1300  # chunks of 512, 512, 276; the first two chunks' KV moves while the next is computed
    r = simulate(c, e, ClusterShape.disaggregated(1, 1), unique_requests([0.0], prompt, 5))
    chunks = c.prefill_s(512, 0) + c.prefill_s(512, 512) + c.prefill_s(276, 1024)
    assert c.transfer_bytes_s(512) < c.prefill_s(512, 512)  # the link keeps up with the prefill
    assert r.tracks[0].first == pytest.approx(chunks + c.transfer_s(276), rel=1e-12)


def test_one_request_colocated_prefills_in_chunks_of_the_token_budget() -> None:
    p = synthetic_profile(max_num_batched_tokens=512)
    c, e = p.costs(), engine_settings(p)
    prompt = 1300  # chunks of 512, 512, 276
    r = simulate(c, e, ClusterShape.colocated(1), unique_requests([0.0], prompt, 5))
    chunks = c.prefill_s(512, 0) + c.prefill_s(512, 512) + c.prefill_s(276, 1024)
    assert r.tracks[0].first == pytest.approx(chunks, rel=1e-12)
    assert r.tracks[0].done - r.tracks[0].first == pytest.approx(decode_sum(c, 1, prompt + 1, 4), rel=1e-9)


def test_requests_arriving_together_prefill_as_one_step_then_decode_as_one_batch() -> None:
    p = synthetic_profile(max_num_batched_tokens=8192)
    c, e = p.costs(), engine_settings(p)
    m, prompt, out = 8, 600, 50
    r = simulate(c, e, ClusterShape.colocated(1), unique_requests([0.0] * m, prompt, out))
    prefill = c.step_s([(prompt, 0)] * m, 0, 0.0)
    decode = sum(c.decode_s(m, prompt + 1 + j) for j in range(out - 1))  # every row's context grows by one
    for tr in r.tracks:
        assert tr.first == pytest.approx(prefill, rel=1e-12)
        assert tr.done == pytest.approx(prefill + decode, rel=1e-9)
    # one decode batch advanced as one segment, not one event per token
    assert r.events < 3 * m + 10


def test_a_late_arrival_joins_the_decode_batch_at_the_next_step_boundary() -> None:
    p = synthetic_profile()
    c, e = p.costs(), engine_settings(p)
    r = simulate(c, e, ClusterShape.colocated(1), unique_requests([0.0, 0.1], 256, 100))
    a, b = r.tracks
    t_a = a.chunk_times()
    assert np.all(np.diff(t_a) > 0)
    # b's prefill starts at a boundary of a's steps: its first token ends a step of a's
    assert np.min(np.abs(t_a - b.first)) < 1e-12
    # the step b prefilled in is mixed: b's prompt and a's row (a has i tokens by then) in one pass
    i = int(np.argmin(np.abs(t_a - b.first)))
    assert t_a[i] - t_a[i - 1] == pytest.approx(c.step_s([(256, 0)], 1, 256 + i), rel=1e-9)
    assert t_a[i - 1] - t_a[i - 2] == pytest.approx(c.decode_s(1, 256 + i - 1), rel=1e-9)


def test_a_queue_of_one_step_requests_waits_as_an_md1_queue() -> None:
    # output 1 and a budget of one prompt: each request is one prefill step of fixed length S,
    # served first come first served: an M/D/1 queue, mean wait = rho * S / (2 (1 - rho)).
    prompt = 512
    p = synthetic_profile(max_num_batched_tokens=prompt)
    c, e = p.costs(), engine_settings(p)
    s = c.prefill_s(prompt, 0)
    rho = 0.6
    n = 20_000
    arrivals = arrival_offsets(n, rho / s, 1.0, seed=3)
    lat = Latencies.of(simulate(c, e, ClusterShape.colocated(1), unique_requests(arrivals, prompt, 1)))
    wait = float(np.mean(lat.ttft)) - s
    assert wait == pytest.approx(rho * s / (2 * (1 - rho)), rel=0.06)


def test_cache_aware_routing_reuses_more_prefix_than_round_robin() -> None:
    p = synthetic_profile(num_kv_blocks=700)  # each worker can hold about half the prefixes
    e = engine_settings(p)
    cfg = BenchConfig("http://sim/v1", workload=WorkloadKind.SHARED_PREFIX, num_requests=400, input_len=700,
                      output_len=16, num_prefix_groups=16, prefix_len=512, request_rate=8.0, seed=1)
    reqs = Workload.build(cfg, e.block_size).at_rate()
    hit = {}
    for policy in RoutingPolicy:
        res = simulate(p.costs(), e, ClusterShape.disaggregated(2, 2, policy), reqs)
        hit[policy] = summary(res)["simulated"]["prefix_hit_rate"]
    assert hit[RoutingPolicy.CACHE_AWARE] > hit[RoutingPolicy.ROUND_ROBIN] + 0.1


def test_more_decode_workers_never_make_tpot_worse() -> None:
    p = synthetic_profile()
    c, e = p.costs(), engine_settings(p)
    reqs = unique_requests(arrival_offsets(600, 12.0, 1.0, seed=5), 512, 128)
    tpot = []
    for d in (1, 2, 3, 4):
        lat = Latencies.of(simulate(c, e, ClusterShape.disaggregated(2, d), reqs))
        tpot.append((lat.percentile("tpot", 50), lat.percentile("tpot", 90)))
    for (p50a, p90a), (p50b, p90b) in zip(tpot, tpot[1:]):
        assert p50b <= p50a * 1.0001 and p90b <= p90a * 1.0001
    assert tpot[-1][0] < tpot[0][0]


def test_a_small_pool_preempts_and_every_request_still_finishes() -> None:
    p = synthetic_profile(num_kv_blocks=200)  # 3200 tokens: a few requests' contexts
    c, e = p.costs(), engine_settings(p)
    r = simulate(c, e, ClusterShape.colocated(1), unique_requests([0.0] * 12, 400, 300))
    assert r.preemptions > 0
    assert all(t.done is not None for t in r.tracks)


@pytest.mark.parametrize("shape", [ClusterShape.colocated(2), ClusterShape.disaggregated(1, 2),
                                   ClusterShape.disaggregated(2, 1, RoutingPolicy.ROUND_ROBIN)],
                         ids=lambda s: s.label)
def test_every_request_finishes_and_every_block_comes_back(shape: ClusterShape) -> None:
    # small pools, shared prefixes, a burst: preemptions, evictions, handoffs and local prefills
    p = synthetic_profile(num_kv_blocks=400, max_num_batched_tokens=512)
    e = engine_settings(p)
    cfg = BenchConfig("http://sim/v1", workload=WorkloadKind.SHARED_PREFIX, num_requests=300, input_len=600,
                      output_len=100, range_ratio=0.5, num_prefix_groups=6, prefix_len=256, request_rate=30.0,
                      burstiness=0.3, seed=2)
    r = simulate(p.costs(), e, shape, Workload.build(cfg, e.block_size).at_rate())
    assert all(t.done is not None and t.first is not None and t.first <= t.done for t in r.tracks)
    assert r.blocks_held == dict.fromkeys(r.blocks_held, 0)
    for t in r.tracks:
        times = t.chunk_times()
        assert np.all(np.diff(times) >= 0) and times[0] == t.first and times[-1] == t.done


def test_speculative_decoding_takes_fewer_steps() -> None:
    prompt, out = 256, 101
    base = synthetic_profile()
    spec = synthetic_profile(tokens_per_step=2.0)
    times = []
    for prof in (base, spec):
        reqs = unique_requests([0.0], prompt, out)
        r = simulate(prof.costs(), engine_settings(prof), ClusterShape.colocated(1), reqs)
        times.append(r.tracks[0].done - r.tracks[0].first)
        if prof is spec:
            assert len(r.tracks[0].chunk_times()) == 1 + 50  # the first token, then 2 per step
    assert times[1] < 0.55 * times[0]


def test_the_admission_bound_refuses_requests_past_it() -> None:
    p = synthetic_profile()
    shape = ClusterShape.colocated(1, max_in_flight=5)
    r = simulate(p.costs(), engine_settings(p), shape, unique_requests([0.0] * 8, 128, 10))
    assert sum(t.rejected is not None for t in r.tracks) == 3
    s = summary(r, SLO(ttft=10.0, tpot=1.0))
    assert s["failed"] == 3 and s["goodput"]["attainment"] == pytest.approx(5 / 8)


def test_a_request_longer_than_max_model_len_is_refused() -> None:
    p = synthetic_profile()  # max_model_len 8192
    c, e = p.costs(), engine_settings(p)
    over = simulate(c, e, ClusterShape.colocated(1), unique_requests([0.0], 8000, 193)).tracks[0]
    assert over.rejected is not None and "max_model_len" in over.rejected
    assert simulate(c, e, ClusterShape.colocated(1), unique_requests([0.0], 8000, 192)).tracks[0].done is not None


def test_one_output_token_runs_on_the_prefill_worker_alone() -> None:
    p = synthetic_profile()
    c = p.costs()
    r = simulate(c, engine_settings(p), ClusterShape.disaggregated(1, 1), unique_requests([0.0], 700, 1))
    assert r.tracks[0].plan == "prefill_only"
    assert r.tracks[0].first == r.tracks[0].done == pytest.approx(c.prefill_s(700, 0), rel=1e-12)


def test_goodput_search_finds_the_rate_where_attainment_crosses_the_target() -> None:
    res = goodput_rate(lambda rate: 1.0 if rate <= 7.3 else 0.5, start=1.0, rel_tol=0.01)
    assert res.bounded and res.rate == pytest.approx(7.3, rel=0.011) and res.rate <= 7.3
    assert goodput_rate(lambda rate: 0.0, start=1.0).rate is None


def test_summary_reports_the_bench_numbers() -> None:
    p = synthetic_profile()
    cfg = BenchConfig("http://sim/v1", num_requests=200, input_len=512, output_len=64, request_rate=4.0)
    e = engine_settings(p)
    r = simulate(p.costs(), e, ClusterShape.disaggregated(1, 1), Workload.build(cfg, e.block_size).at_rate())
    s = summary(r, SLO(ttft=0.5, tpot=0.05))
    assert s["completed"] == 200
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
    assert 0.0 <= s["goodput"]["attainment"] <= 1.0
    assert math.isfinite(s["request_throughput"])


def test_simulated_requests_per_wall_second(capsys: pytest.CaptureFixture[str]) -> None:
    """Prints the simulator's speed (not asserted: timed tests are banned)."""
    import time

    p = synthetic_profile()
    e = engine_settings(p)
    cfg = BenchConfig("http://sim/v1", workload=WorkloadKind.SHARED_PREFIX, num_requests=2000, input_len=1024,
                      output_len=128, request_rate=16.0)
    reqs = Workload.build(cfg, e.block_size).at_rate()
    for shape in (ClusterShape.colocated(2), ClusterShape.disaggregated(1, 1)):
        t0 = time.perf_counter()
        simulate(p.costs(), e, shape, reqs)
        dt = time.perf_counter() - t0
        with capsys.disabled():
            print(f"\nsimulator: {shape.label}: {len(reqs)} requests in {dt:.2f} s = {len(reqs) / dt:,.0f} req/s")


def test_the_router_counts_a_decode_workers_queue_as_the_gateway_reports_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's router reads a decode worker's load as its running + waiting requests
    (DisaggregatedBackend._refresh_one: waiting holds reservations whose KV has not landed,
    landed ones the batch has no room for yet, and queued prompts). The simulated router must
    see the same: counting only running + reservations, a worker at max_num_seqs with a queue
    looked as loaded as one with none, and took more."""
    import pdserve.cluster.planner.simulator as sim

    p = synthetic_profile(max_num_seqs=2)
    c, e = p.costs(), engine_settings(p)
    seen: list[tuple[dict[str, int], dict[str, int]]] = []
    route, snapshot = sim.route, sim._Cluster._route

    def spy_route(self: sim._Cluster, req: object, track: object, t: float) -> None:
        # what the gateway's report would say of each decode worker as this request is routed
        want = {w.wid: len(w.running) + len(w.waiting) + w.awaiting_kv for w in self.workers
                if w.role is sim.WorkerRole.DECODE}

        def routed(snap: sim.RouterSnapshot, *args: object) -> object:
            seen.append(({load.worker_id: load.running_requests for load in snap.loads
                          if load.role is sim.WorkerRole.DECODE}, want))
            return route(snap, *args)

        monkeypatch.setattr(sim, "route", routed)
        snapshot(self, req, track, t)  # type: ignore[arg-type]

    monkeypatch.setattr(sim._Cluster, "_route", spy_route)
    r = simulate(c, e, ClusterShape.disaggregated(1, 2), unique_requests([0.01 * i for i in range(30)], 256, 60))
    assert all(t.done is not None for t in r.tracks)
    assert any(sum(want.values()) > 4 for _, want in seen)  # queues formed behind max_num_seqs
    for got, want in seen:
        assert got == want
