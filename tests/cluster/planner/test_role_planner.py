"""The planner loop's decision: a window of the gateway's histograms -> the split it wants.

The windows are made the way the gateway makes them (prometheus_client histograms,
one observation per finished request); the decisions come from simulating the
window's traffic on the synthetic profile, whose costs are known exactly."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram
from sim_factories import synthetic_profile

from pdserve.cluster.bench.metrics import SLO
from pdserve.cluster.metrics import TOKEN_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from pdserve.cluster.planner.role_planner import Split, recommend
from pdserve.cluster.planner.simulator import engine_settings
from pdserve.cluster.planner.traffic import (
    GENERATION_TOKENS,
    PROMPT_TOKENS,
    TPOT,
    TTFT,
    TrafficReader,
    TrafficWindow,
)
from pdserve.cluster.router.policy import WorkerRole

SLO_ = SLO(ttft=0.2, tpot=0.02)


class Gateway:
    """The four histograms the gateway keeps, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.prompt = Histogram(PROMPT_TOKENS, "prompt tokens per request", buckets=TOKEN_BUCKETS, registry=r)
        self.output = Histogram(GENERATION_TOKENS, "output tokens per request", buckets=TOKEN_BUCKETS, registry=r)
        self.ttft = Histogram(TTFT, "ttft", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(TPOT, "tpot", buckets=TPOT_BUCKETS, registry=r)
        self.reader = TrafficReader(r)

    def finish(self, n: int, prompt: int, output: int, ttft: float = 0.05, tpot: float = 0.01) -> None:
        for _ in range(n):
            self.prompt.observe(prompt)
            self.output.observe(output)
            self.ttft.observe(ttft)
            self.tpot.observe(tpot)


def test_a_window_is_what_changed_since_the_last_read() -> None:
    gw = Gateway()
    gw.finish(50, 100, 300)  # before the baseline: not in any window
    assert gw.reader.take(0.0) is None
    gw.finish(40, 1900, 20, ttft=0.6)
    gw.finish(20, 100, 300)
    w = gw.reader.take(20.0)
    assert w is not None and w.requests == 60 and w.rate == pytest.approx(3.0)
    # Bucket (1000, 2000] holds 40, (50, 100] holds 20: the midpoints' mean.
    assert w.mean("prompt_tokens") == pytest.approx((40 * 1500 + 20 * 75) / 60)
    reqs = w.synthetic_requests(600, block_size=16, seed=1)
    long = [r.prompt_len for r in reqs if r.prompt_len > 100]
    assert all(1000 < p <= 2000 for p in long) and all(50 < r.prompt_len <= 100 for r in reqs if r.prompt_len <= 100)
    assert 0.55 < len(long) / len(reqs) < 0.78  # two thirds of the window's requests were long
    # Poisson arrivals at the window's rate; no two requests share a block.
    assert reqs[-1].arrival / (len(reqs) - 1) == pytest.approx(1 / 3.0, rel=0.15)
    hashes = [h for r in reqs for h in r.block_hashes]
    assert len(hashes) == len(set(hashes))
    empty = gw.reader.take(30.0)
    assert empty is not None and empty.requests == 0
    with pytest.raises(ValueError, match="no finished requests"):
        empty.synthetic_requests(10, 16)


def test_observed_attainment_comes_from_the_latency_histograms() -> None:
    from pdserve.cluster.planner.role_planner import observed_attainment

    gw = Gateway()
    gw.reader.take(0.0)
    gw.finish(30, 100, 100, ttft=0.05)
    gw.finish(10, 100, 100, ttft=1.5)  # misses the 200 ms TTFT SLO
    w = gw.reader.take(10.0)
    assert w is not None and observed_attainment(w, SLO_) == pytest.approx(0.75)


def test_observed_attainment_counts_an_e2e_slo() -> None:
    """With an e2e SLO the prediction counts it (Latencies.attainment), and the gateway keeps an
    E2E histogram: the observed share must count it too, not report 100% for a window in which a
    quarter of the requests ended past it."""
    from pdserve.cluster.metrics import E2E_BUCKETS
    from pdserve.cluster.planner.role_planner import observed_attainment

    gw = Gateway()
    e2e = Histogram("pdserve:e2e_request_latency_seconds", "e2e", buckets=E2E_BUCKETS, registry=gw.registry)
    gw.reader.take(0.0)
    gw.finish(40, 100, 100)  # TTFT and TPOT within the SLO, all of them
    for seconds in [0.5] * 30 + [5.0] * 10:
        e2e.observe(seconds)
    w = gw.reader.take(10.0)
    assert w is not None
    assert observed_attainment(w, SLO(ttft=0.2, tpot=0.02, e2e=1.0)) == pytest.approx(0.75)
    assert observed_attainment(w, SLO(e2e=1.0)) == pytest.approx(0.75)
    assert observed_attainment(w, SLO_) == pytest.approx(1.0)


def _window(prompt: int, output: int, rate: float, seconds: float = 20.0) -> TrafficWindow:
    gw = Gateway()
    gw.reader.take(0.0)
    gw.finish(int(rate * seconds), prompt, output)
    w = gw.reader.take(seconds)
    assert w is not None
    return w


def test_a_shift_to_long_prompts_wants_more_prefill_workers_and_back() -> None:
    """3 workers. Short prompts with long outputs at 30 req/s need decode capacity;
    long prompts with short outputs at 70 req/s saturate one prefill worker."""
    prof = synthetic_profile()
    costs, engine = prof.costs(), engine_settings(prof)
    short = recommend(costs, engine, _window(100, 300, 30.0), Split(2, 1), SLO_)
    assert short.best == Split(1, 2) and short.move == (WorkerRole.PREFILL, WorkerRole.DECODE)
    assert short.predicted[Split(1, 2)] >= 0.9 > short.predicted[Split(2, 1)]
    long = recommend(costs, engine, _window(1900, 20, 70.0), Split(1, 2), SLO_)
    assert long.best == Split(2, 1) and long.move == (WorkerRole.DECODE, WorkerRole.PREFILL)
    assert long.predicted[Split(2, 1)] >= 0.9 > long.predicted[Split(1, 2)]
    assert "1P+2D -> 2P+1D" in long.describe()


def test_the_current_split_stays_unless_another_wins_by_the_margin() -> None:
    prof = synthetic_profile()
    costs, engine = prof.costs(), engine_settings(prof)
    light = recommend(costs, engine, _window(1900, 20, 5.0), Split(1, 2), SLO_)  # both splits meet it
    assert light.best == Split(1, 2) and light.move is None
    assert light.predicted[Split(2, 1)] == pytest.approx(light.predicted[Split(1, 2)], abs=0.05)


def test_a_window_of_requests_that_fit_predicts_no_request_refused_as_too_long() -> None:
    """Every request the gateway counted finished, so each fit max_model_len (a longer one is
    a 400). Drawn uniform inside the wide 1-2-5 buckets, 1100 + 300 tokens became up to
    2000 + 500: the simulated admission refused the ones past 2048 as too long, and every
    split's predicted attainment fell by that share, at a load every split meets."""
    import dataclasses

    prof = synthetic_profile()
    prof = dataclasses.replace(prof, engine=dataclasses.replace(prof.engine, max_model_len=2048))
    costs, engine = prof.costs(), engine_settings(prof)
    rec = recommend(costs, engine, _window(1100, 300, 2.0), Split(1, 2), SLO_)
    assert all(a >= 0.95 for a in rec.predicted.values()), rec.describe()
    assert rec.move is None


def test_a_split_needs_a_worker_in_each_pool() -> None:
    with pytest.raises(ValueError, match="needs >= 1 prefill and >= 1 decode"):
        Split(0, 3)


def _loop(gw: Gateway, split: list[Split], apply: bool, moves: list[tuple[WorkerRole, WorkerRole]],
          fail: bool = False):  # noqa: ANN202
    import asyncio

    from pdserve.cluster.planner.role_loop import PlannerSettings, RolePlannerLoop

    now = [0.0]

    async def move(src: WorkerRole, dst: WorkerRole) -> None:
        await asyncio.sleep(0)
        if fail:
            raise RuntimeError("the pool would be empty")
        moves.append((src, dst))
        split[0] = Split(split[0].prefill + (1 if dst is WorkerRole.PREFILL else -1),
                         split[0].decode + (1 if dst is WorkerRole.DECODE else -1))

    settings = PlannerSettings(synthetic_profile(), SLO_, interval_s=20.0, min_requests=20, apply=apply)
    loop = RolePlannerLoop(settings, gw.registry, lambda: split[0], move, clock=lambda: now[0])
    loop.reader.take(now[0])
    return loop, now


def _sample(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float | None:
    return registry.get_sample_value(name, labels or {})


def test_the_loop_moves_one_worker_per_window_toward_the_split_the_traffic_wants() -> None:
    import asyncio

    gw, split, moves = Gateway(), [Split(1, 2)], []
    loop, now = _loop(gw, split, apply=True, moves=moves)

    async def run() -> None:
        now[0] = 20.0
        gw.finish(5, 1900, 20)  # too few to act on
        assert await loop.tick() is None
        now[0] = 40.0
        gw.finish(1400, 1900, 20)  # the load shifts to long prompts: 70 req/s
        rec = await loop.tick()
        assert rec is not None and rec.move == (WorkerRole.DECODE, WorkerRole.PREFILL)
        now[0] = 60.0
        gw.finish(1400, 1900, 20)
        again = await loop.tick()  # measured on the new split: it stays
        assert again is not None and again.current == Split(2, 1) and again.move is None

    asyncio.run(run())
    assert moves == [(WorkerRole.DECODE, WorkerRole.PREFILL)] and split[0] == Split(2, 1)
    r = gw.registry
    assert _sample(r, "pdserve:planner_decisions_total", {"decision": "applied"}) == 1
    assert _sample(r, "pdserve:planner_decisions_total", {"decision": "skipped"}) == 1
    assert _sample(r, "pdserve:planner_decisions_total", {"decision": "keep"}) == 1
    assert _sample(r, "pdserve:planner_recommended_workers", {"pool": "prefill"}) == 2
    assert _sample(r, "pdserve:planner_predicted_slo_attainment", {"split": "current"}) == pytest.approx(1.0)
    assert _sample(r, "pdserve:planner_predicted_slo_attainment", {"split": "recommended"}) == pytest.approx(1.0)


def test_without_autoscale_the_loop_only_recommends_and_a_failed_move_keeps_serving() -> None:
    import asyncio

    gw, split, moves = Gateway(), [Split(1, 2)], []
    loop, now = _loop(gw, split, apply=False, moves=moves)
    gw.finish(1400, 1900, 20)
    now[0] = 20.0
    rec = asyncio.run(loop.tick())
    assert rec is not None and rec.move is not None and moves == [] and split[0] == Split(1, 2)
    assert _sample(gw.registry, "pdserve:planner_decisions_total", {"decision": "recommend"}) == 1

    gw2, split2 = Gateway(), [Split(1, 2)]
    loop2, now2 = _loop(gw2, split2, apply=True, moves=moves, fail=True)
    gw2.finish(1400, 1900, 20)
    now2[0] = 20.0
    asyncio.run(loop2.tick())
    assert split2[0] == Split(1, 2)
    assert _sample(gw2.registry, "pdserve:planner_decisions_total", {"decision": "failed"}) == 1


def test_the_window_after_a_move_starts_once_the_move_is_over() -> None:
    """A move drains a worker (up to its deadline) and moves what it holds: the requests that end
    meanwhile are the switch's, late, on neither split. The next window must start when the move
    ends ('the next window measures the new split'), not take them as the new split's."""
    import asyncio

    gw, split, moves = Gateway(), [Split(1, 2)], []
    loop, now = _loop(gw, split, apply=True, moves=moves)
    moved = loop.move
    assert moved is not None

    async def slow_move(src: WorkerRole, dst: WorkerRole) -> object:
        gw.finish(300, 1900, 20, ttft=1.5)  # finished late while the worker drained
        now[0] += 30.0
        return await moved(src, dst)

    loop.move = slow_move

    async def run() -> None:
        now[0] = 20.0
        gw.finish(1400, 1900, 20)
        rec = await loop.tick()
        assert rec is not None and rec.move == (WorkerRole.DECODE, WorkerRole.PREFILL)
        now[0] += 20.0
        gw.finish(100, 1900, 20)  # on the new split
        again = await loop.tick()
        assert again is not None and again.current == Split(2, 1)
        assert again.rate == pytest.approx(100 / 20.0) and again.observed_attainment == pytest.approx(1.0)

    asyncio.run(run())
    assert moves == [(WorkerRole.DECODE, WorkerRole.PREFILL)]
