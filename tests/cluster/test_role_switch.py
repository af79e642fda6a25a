"""Workers that change role (prefill <-> decode) while the cluster serves: real
engines and ZeroMQ KV transport in one process, Ray handles replaced by
`LocalActor` (as in test_disagg_backend.py). Every request finishes with the
offline engine's greedy tokens, and no KV block stays used anywhere."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import LocalActor, slow_steps, tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.cluster.actors import DecodeService, PrefillService, WorkerService
from pdserve.cluster.disagg_backend import DisaggregatedBackend
from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.reports import LoadReport, RoleSwitch
from pdserve.cluster.router import Router, RoutingDecision, WorkerRole
from pdserve.cluster.router.policy import RouterConfig
from pdserve.workers.async_engine import WorkerDrainingError
from pdserve.workers.config import EngineConfig
from pdserve.workers.handoff import KVFailurePolicy, ServeRequest
from pdserve.workers.messages import KVEventBatch
from pdserve.workers.stats import EngineSnapshot
from pdserve.workers.tiny.builder import TinyModelSpec

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))


_services: list[WorkerService] = []


@pytest.fixture(autouse=True)
def _close_services() -> Iterator[None]:
    yield
    while _services:
        _services.pop().close()


def cluster(model_dir: Path, num_prefill: int, num_decode: int, poll_s: float = 0.01,
            on_kv_failure: KVFailurePolicy = KVFailurePolicy.RECOMPUTE,
            **engine_args: Any) -> tuple[DisaggregatedBackend, dict[str, WorkerService]]:
    """`num_prefill` + `num_decode` workers (p0.., d0..) behind one backend; every prompt is
    handed off (no local prefill) while a prefill worker is there."""
    base = EngineConfig(model=str(model_dir), max_model_len=1024, block_size=BS, max_num_batched_tokens=1024,
                        num_kv_blocks=512, **engine_args)
    services: dict[str, WorkerService] = {}
    for i in range(num_prefill):
        services[f"p{i}"] = PrefillService(base, 1, worker_name=f"p{i}", kv_host="127.0.0.1",
                                           on_kv_failure=on_kv_failure)
    for i in range(num_decode):
        services[f"d{i}"] = DecodeService(replace(base, num_kv_blocks=1024), 1, "127.0.0.1",
                                          on_kv_failure=on_kv_failure, worker_name=f"d{i}")
    _services.extend(services.values())
    actors = {k: LocalActor(v) for k, v in services.items()}
    router = Router(RouterConfig(local_prefill_threshold_tokens=0), BS)
    backend = DisaggregatedBackend({k: a for k, a in actors.items() if k[0] == "p"},
                                   {k: a for k, a in actors.items() if k[0] == "d"}, router, poll_s=poll_s)
    return backend, services


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (int(k),), generator=g).tolist()
            for k in torch.randint(20, 160, (n,), generator=g)]


def offline(model_dir: Path, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    llm = LLM(str(model_dir), max_model_len=1024, num_kv_blocks=512, progress=False)
    return [o.outputs[0].token_ids for o in llm.generate(ps, params)]


class Load:
    """Streams running through the backend: their tokens, and how many have any yet."""

    def __init__(self, backend: DisaggregatedBackend, ps: list[list[int]], tag: str,
                 params: SamplingParams = GREEDY) -> None:
        self.tokens: list[list[int]] = [[] for _ in ps]
        self.tasks = [asyncio.ensure_future(self._one(backend, f"{tag}{i}", p, i, params)) for i, p in enumerate(ps)]

    async def _one(self, backend: DisaggregatedBackend, rid: str, prompt: list[int], i: int,
                   params: SamplingParams) -> None:
        async for out in backend.generate(rid, prompt, params, 60):
            self.tokens[i] += out.outputs[0].token_ids

    async def all_streaming(self) -> None:
        """Until every stream has a token (each is under way)."""
        await until(lambda: all(self.tokens))

    async def done(self) -> list[list[int]]:
        await asyncio.wait_for(asyncio.gather(*self.tasks), timeout=60)
        return self.tokens


async def until(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Until `check()`, failing the test past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s"
        await asyncio.sleep(0.002)


def assert_no_block_used(services: dict[str, WorkerService]) -> None:
    async def states() -> dict[str, Any]:
        return {name: await s.drain_state() for name, s in services.items()}

    for name, state in asyncio.run(states()).items():
        assert state.drained, (name, state)


# Structured outputs across the switches: the grammar's state goes with the request's tokens.
RECORD = {"type": "object", "properties": {"name": {"type": "string", "minLength": 30, "maxLength": 40},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9999}},
          "required": ["name", "n"], "additionalProperties": False}
CONSTRAINED = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs={"json": RECORD})


@pytest.mark.parametrize("params", [GREEDY, CONSTRAINED], ids=["greedy", "json-schema"])
def test_workers_switch_role_under_load_and_every_stream_matches_offline(
        model_dir: Path, caplog: pytest.LogCaptureFixture, params: SamplingParams) -> None:
    """2 prefill + 1 decode, 14 greedy streams under way: p1 becomes a decode worker,
    then d0 (its pool has p1 now) a prefill worker, each draining what it holds; a
    second wave runs on the new split. Every stream equals offline, every pool ends
    with no block used. Every engine speculates (n-gram) when it decodes: p1, born to
    prefill, too, once it switched. The same under a JSON schema."""
    # the second wave repeats itself, so the n-gram proposer finds drafts in it
    first, second = prompts(14, seed=1), prompts(6, seed=2)
    backend, services = cluster(model_dir, 2, 1, speculative="ngram")
    slow_steps(services["p1"].engine, 0.01)
    slow_steps(services["d0"].engine, 0.002)

    async def main() -> tuple[list[list[int]], list[list[int]], list[Any]]:
        try:
            load = Load(backend, first, "a", params)
            await until(lambda: services["p1"].async_engine.num_in_flight > 0)  # it is prefilling
            switches = [await backend.switch_role("p1", WorkerRole.DECODE, drain_timeout_s=30)]
            await load.all_streaming()
            switches.append(await backend.switch_role("d0", WorkerRole.PREFILL, drain_timeout_s=30))
            after = Load(backend, second, "b", params)
            return await load.done(), await after.done(), switches
        finally:
            await backend.close()

    with caplog.at_level(logging.WARNING, logger="pdserve.cluster.role_switch"):
        got_first, got_second, switches = asyncio.run(main())
    assert got_first == offline(model_dir, first, params)
    assert got_second == offline(model_dir, second, params)
    assert [(s.from_role, s.to_role, s.migrated) for s in switches] == \
        [(WorkerRole.PREFILL, WorkerRole.DECODE, 0), (WorkerRole.DECODE, WorkerRole.PREFILL, 0)]
    assert switches[0].drained > 0  # p1's prefills finished there
    assert switches[0].speculative and "decodes without speculative decoding" not in caplog.text
    assert set(backend.prefill) == {"p0", "d0"} and set(backend.decode) == {"p1"}
    assert services["p1"].engine.stats.generation_tokens > 0  # it decoded the second wave
    # its engine holds the n-gram speculator (random prompts rarely give it an n-gram to draft)
    assert services["p1"].engine.spec is not None and services["p1"].engine.config.speculative == "ngram"
    assert services["d0"].switcher.num_switches == 1
    r = backend.reliability()
    assert (r.role_switches_to_decode, r.role_switches_to_prefill, r.role_switch_failures, r.migrations) == (1, 1, 0, 0)
    assert_no_block_used(services)


def test_the_router_learns_the_new_split_at_once(model_dir: Path) -> None:
    """With polls 30 s apart, the requests routed right after a switch (through the
    gateway's one awaitable call) already use the new split, and the router holds
    nothing of the worker's old prefix cache. The gateway exports the switch and the
    pools' sizes."""
    backend, services = cluster(model_dir, 2, 1, poll_s=30)
    gw = Gateway(backend, None, GatewayConfig(model_name="m", max_model_len=1024))
    ps = prompts(6, seed=3)
    decisions: list[RoutingDecision] = []
    route = backend.router.route

    def recording(*args: Any, **kwargs: Any) -> RoutingDecision:
        decisions.append(route(*args, **kwargs))
        return decisions[-1]

    backend.router.route = recording  # type: ignore[method-assign]

    async def main() -> tuple[list[list[int]], str]:
        try:
            await Load(backend, ps, "warm").done()  # every worker caches something
            await backend._refresh()  # the router learns what (one poll)
            assert backend.router.index.num_blocks("p1") > 0
            switch = await gw.switch_role("p1", WorkerRole.DECODE, drain_timeout_s=30)
            assert switch.to_role is WorkerRole.DECODE and switch.migrated == 0
            assert backend.router.index.num_blocks("p1") == 0
            assert backend.router.loads["p1"].role is WorkerRole.DECODE and backend.router.loads["p1"].healthy
            decisions.clear()
            slow_steps(services["d0"].engine, 0.002)  # d0 stays busy: the router must see p1's room to use it
            got = await Load(backend, ps, "after").done()
            assert b'pool="decode",worker="p1"' in await services["p1"].metrics()  # its own metrics say so too
            return got, (await gw.metrics.exposition({})).decode()
        finally:
            await backend.close()

    got, metrics = asyncio.run(main())
    assert got == offline(model_dir, ps)
    assert {d.prefill_worker for d in decisions} <= {"p0"}
    assert "p1" in {d.decode_worker for d in decisions}
    assert 'pdserve:role_switches_total{to_pool="decode"} 1.0' in metrics
    assert 'pdserve:pool_workers_configured{pool="prefill"} 1.0' in metrics
    assert 'pdserve:pool_workers_configured{pool="decode"} 2.0' in metrics
    assert_no_block_used(services)


def test_a_switch_that_would_empty_a_pool_is_refused(model_dir: Path) -> None:
    """The backend refuses, changing nothing, a switch that would leave a pool with no
    live worker, of a worker already in that pool or unknown, or of a worker already
    switching; a worker refuses a call for the role it does not hold (retryable)."""
    backend, services = cluster(model_dir, 2, 1)

    async def main() -> None:
        try:
            await backend.start()
            with pytest.raises(ValueError, match="decode pool would be left with no live worker"):
                await backend.switch_role("d0", WorkerRole.PREFILL)
            with pytest.raises(ValueError, match="a prefill worker already"):
                await backend.switch_role("p0", WorkerRole.PREFILL)
            with pytest.raises(ValueError, match="no worker 'x9'"):
                await backend.switch_role("x9", WorkerRole.DECODE)
            with pytest.raises(ValueError, match="prefill or decode"):
                await backend.switch_role("p0", WorkerRole.BOTH)
            for bad in (-1.0, float("nan"), float("inf")):  # refused here: it reached the worker, counted failed
                with pytest.raises(ValueError, match="drain_timeout_s"):
                    await backend.switch_role("p1", WorkerRole.DECODE, drain_timeout_s=bad)
            assert backend.router.loads["p1"].healthy
            first = asyncio.ensure_future(backend.switch_role("p1", WorkerRole.DECODE, drain_timeout_s=5))
            await asyncio.sleep(0)  # it has taken p1 out of its pool
            with pytest.raises(ValueError, match="switch is under way"):
                await backend.switch_role("p1", WorkerRole.DECODE)
            await first
            with pytest.raises(ValueError, match="prefill pool would be left with no live worker"):
                await backend.switch_role("p0", WorkerRole.DECODE)
            req = ServeRequest("r", (5, 6, 7), GREEDY, 10, None)
            with pytest.raises(WorkerDrainingError, match="p1 is a decode worker"):
                await services["p1"].prefill(None)  # type: ignore[arg-type]
            with pytest.raises(WorkerDrainingError, match="p0 is a prefill worker"):
                await services["p0"].serve(req)  # more than one token: a decode worker's
        finally:
            await backend.close()

    asyncio.run(main())
    assert set(backend.prefill) == {"p0"} and set(backend.decode) == {"d0", "p1"}
    assert backend.reliability().role_switch_failures == 0


def test_a_switch_the_worker_refuses_is_no_failure(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker refuses (another gateway replica is switching it): a ValueError, as the
    backend's own refusals; it was counted as a failed switch, a false alert."""
    backend, services = cluster(model_dir, 2, 1)

    async def refuse(role: WorkerRole, drain_timeout_s: float) -> None:
        raise ValueError("worker p1: a role switch is under way")

    monkeypatch.setattr(services["p1"], "switch_role", refuse)

    async def main() -> None:
        try:
            await backend.start()
            with pytest.raises(ValueError, match="under way"):
                await backend.switch_role("p1", WorkerRole.DECODE)
            await backend._refresh()
        finally:
            await backend.close()

    asyncio.run(main())
    assert set(backend.prefill) == {"p0", "p1"} and backend.reliability().role_switch_failures == 0


def test_a_switched_workers_lifetime_counters_go_on_from_where_they_were(model_dir: Path) -> None:
    """The switch's new metrics registry started from a zero reading of the engine: a scrape
    before its first sample (an engine step longer than the sample's wait) showed the engine's
    lifetime counters at 0, then back at their totals, which rate() reads as a burst."""
    from prometheus_client.parser import text_string_to_metric_families

    backend, services = cluster(model_dir, 2, 1)

    def lifetime(svc: Any) -> dict[str, float]:
        names = ("pdserve:prefix_cache_queries_total", "pdserve:num_preemptions_total")
        return {s.name: s.value for f in text_string_to_metric_families(svc.worker_metrics.render().decode())
                for s in f.samples if s.name in names}

    async def main() -> dict[str, float]:
        try:
            await Load(backend, prompts(6, seed=3), "warm").done()
            svc = services["p1"]
            await svc.async_engine.call(svc.worker_metrics.sample)
            before = lifetime(svc)
            await backend.switch_role("p1", WorkerRole.DECODE)
            assert lifetime(svc) == before  # no sample taken since: the last reading goes on
            return before
        finally:
            await backend.close()

    before = asyncio.run(main())
    assert before["pdserve:prefix_cache_queries_total"] > 0


def test_past_the_drain_deadline_requests_move_on_and_still_match_offline(model_dir: Path) -> None:
    """2 prefill + 2 decode, 12 greedy streams, slow workers, no time to drain. p1
    becomes a decode worker while it prefills: the prompts it held are computed by
    their decode workers instead (even with the `fail` policy: a worker changing role
    is no KV failure). Then d0 becomes a prefill worker while it decodes:
    the streams it held are cut and resumed on the decode pool from the tokens their
    clients had. Every stream equals offline; no block stays used on any worker."""
    ps = prompts(12, seed=4)
    params = replace(GREEDY, max_tokens=96)
    backend, services = cluster(model_dir, 2, 2, on_kv_failure=KVFailurePolicy.FAIL)
    slow_steps(services["p1"].engine, 0.02)
    for name in ("d0", "d1"):
        slow_steps(services[name].engine, 0.003)

    async def main() -> tuple[list[list[int]], list[Any]]:
        try:
            load = Load(backend, ps, "m", params)
            await until(lambda: services["p1"].async_engine.num_in_flight > 0)
            switches = [await backend.switch_role("p1", WorkerRole.DECODE, drain_timeout_s=0)]
            await load.all_streaming()
            switches.append(await backend.switch_role("d0", WorkerRole.PREFILL, drain_timeout_s=0))
            return await load.done(), switches
        finally:
            await backend.close()

    got, switches = asyncio.run(main())
    assert got == offline(model_dir, ps, params)
    assert all(s.migrated > 0 for s in switches), switches
    r = backend.reliability()
    assert r.migrations >= switches[1].migrated and r.exhausted == 0  # p1's prompts did not move: recomputed
    assert set(backend.prefill) == {"p0", "d0"} and set(backend.decode) == {"d1", "p1"}
    assert_no_block_used(services)


@pytest.mark.parametrize("name", ["d0", "p0"])
def test_a_switch_that_fails_once_the_old_role_is_closed_leaves_a_role_that_serves(model_dir: Path,
                                                                                   name: str) -> None:
    """The old role closed (a decode role's wait threads shut down, a prefill role's KV
    links closed), then the switch failed. The worker takes a new role of the old kind:
    what it is sent next is served, not failed by the closed role's parts. The `fail`
    policy, so a prefill worker's failed transfer would fail its request."""
    ps = prompts(4, seed=7)
    backend, services = cluster(model_dir, 1, 1, on_kv_failure=KVFailurePolicy.FAIL)
    svc = services[name]
    old = svc.role

    def close_then_fail() -> None:
        type(old).close(old)
        raise OSError("the KV socket would not close")

    old.close = close_then_fail  # type: ignore[method-assign]

    async def main() -> list[list[int]]:
        try:
            to = WorkerRole.PREFILL if name == "d0" else WorkerRole.DECODE
            with pytest.raises(OSError, match="would not close"):
                await svc.switch_role(to, drain_timeout_s=1.0)
            got = await Load(backend, ps, "f").done()
            assert svc.role is not old and svc.role.role is old.role
            assert not svc.switcher.switching and svc.switcher.num_switches == 0
            return got
        finally:
            await backend.close()

    assert asyncio.run(main()) == offline(model_dir, ps)
    r = backend.reliability()
    assert r.migrations == 0 and r.exhausted == 0
    assert services["p0"].engine.stats.prompt_tokens_computed == sum(map(len, ps))  # every prompt handed off
    assert services["d0"].engine.stats.prompt_tokens_computed == 0
    assert_no_block_used(services)


class _Worker:
    """A worker's load reports and switches, without an engine (what another gateway
    or a restart does to it is set from the test)."""

    def __init__(self, name: str, role: WorkerRole) -> None:
        self.name, self.role, self.epoch, self.incarnation, self.seq = name, role, 0, "1", 0
        self.fail = False  # the next switch fails (after the drain: the worker keeps its role)

    async def load(self, since: object = None) -> LoadReport:
        self.seq += 1
        return LoadReport(EngineSnapshot(free_blocks=64, total_blocks=64),
                          KVEventBatch(worker_id=self.name, log_id="", first_seq=0, next_seq=0,
                                       snapshot=True, events=()), self.incarnation,
                          self.role, False, self.epoch)

    async def switch_role(self, role: WorkerRole, drain_timeout_s: float) -> RoleSwitch:
        if self.fail:
            raise RuntimeError("cannot bind the KV receiver")
        old, self.role, self.epoch = self.role, role, self.epoch + 1
        return RoleSwitch(old, role, 0, 0, 0.0, False, self.incarnation, self.epoch)


def test_the_backend_follows_the_role_a_worker_reports() -> None:
    """Another gateway switched a worker, Ray restarted one in the role it was created
    with, or a switch failed: the backend puts the worker in the pool its reports
    name (the newest role change it knows of wins), and routes to it there."""
    p0, p1, d0 = _Worker("p0", WorkerRole.PREFILL), _Worker("p1", WorkerRole.PREFILL), _Worker("d0", WorkerRole.DECODE)
    backend = DisaggregatedBackend({"p0": LocalActor(p0), "p1": LocalActor(p1)}, {"d0": LocalActor(d0)},
                                   Router(RouterConfig(), BS))

    def pools() -> tuple[set[str], set[str]]:
        return set(backend.prefill), set(backend.decode)

    async def main() -> None:
        await backend._refresh()
        p1.role, p1.epoch = WorkerRole.DECODE, 1  # another gateway switched it
        await backend._refresh()
        assert pools() == ({"p0"}, {"d0", "p1"}) and backend.router.loads["p1"].role is WorkerRole.DECODE
        p1.role, p1.epoch, p1.incarnation = WorkerRole.PREFILL, 0, "2"  # restarted as it was created
        await backend._refresh()
        assert pools() == ({"p0", "p1"}, {"d0"}) and backend.events.restarted == 1
        p1.fail = True
        with pytest.raises(RuntimeError, match="cannot bind"):
            await backend.switch_role("p1", WorkerRole.DECODE)
        assert pools() == ({"p0", "p1"}, {"d0"}) and not backend.router.loads["p1"].healthy
        await backend._refresh()  # it answers, still a prefill worker
        assert backend.router.loads["p1"].healthy and backend.router.loads["p1"].role is WorkerRole.PREFILL
        p1.fail = False
        switch = await backend.switch_role("p1", WorkerRole.DECODE)
        assert switch.epoch == 1 and pools() == ({"p0"}, {"d0", "p1"})
        await backend._refresh()
        assert pools() == ({"p0"}, {"d0", "p1"})

    asyncio.run(main())
    r = backend.reliability()
    assert (r.role_switches_to_decode, r.role_switch_failures) == (1, 1)


def test_the_planner_loop_moves_a_worker_when_the_traffic_shifts_to_long_prompts(model_dir: Path) -> None:
    """--autoscale-roles: the gateway's planner loop sees a window of long prompts at a
    rate one prefill worker cannot take (in the gateway's own histograms), predicts the
    split that meets the SLOs (synthetic profile: 2P+1D), and moves the least busy
    decode worker to prefill while streams run. The streams finish with the offline
    tokens, and the backend routes on the new split."""
    from pdserve.cluster.bench.metrics import SLO
    from pdserve.cluster.planner.role_loop import PlannerSettings
    from tests.cluster.planner.sim_factories import synthetic_profile

    backend, services = cluster(model_dir, 1, 2)
    settings = PlannerSettings(synthetic_profile(), SLO(ttft=0.2, tpot=0.02), interval_s=3600, min_requests=20,
                               apply=True)
    gw = Gateway(backend, None, GatewayConfig(model_name="m", max_model_len=1024, planner=settings))
    assert gw.planner is not None
    clock = [0.0]
    gw.planner.clock = lambda: clock[0]
    ps = prompts(12, seed=5)

    async def main() -> list[list[int]]:
        try:
            assert gw.planner is not None
            await backend.start()
            gw.start_planner()  # the window starts now (clock 0)
            for _ in range(1400):  # 20 s of long prompts at 70 req/s, as the gateway records them
                gw.metrics.request_prompt_tokens.observe(1900)
                gw.metrics.request_generation_tokens.observe(20)
            load = Load(backend, ps, "a")
            await load.all_streaming()
            clock[0] = 20.0
            rec = await gw.planner.tick()
            assert rec is not None and rec.move == (WorkerRole.DECODE, WorkerRole.PREFILL)
            assert backend.pool_split() == (2, 1)
            return await load.done()
        finally:
            await gw.close()

    assert asyncio.run(main()) == offline(model_dir, ps)
    text = gw.registry
    assert text.get_sample_value("pdserve:planner_decisions_total", {"decision": "applied"}) == 1
    assert text.get_sample_value("pdserve:planner_recommended_workers", {"pool": "prefill"}) == 2
    assert_no_block_used(services)


def test_the_planner_needs_pools_to_size() -> None:
    from pdserve.cluster.backend import ColocatedBackend
    from pdserve.cluster.bench.metrics import SLO
    from pdserve.cluster.planner.role_loop import PlannerSettings
    from tests.cluster.planner.sim_factories import synthetic_profile

    settings = PlannerSettings(synthetic_profile(), SLO(ttft=0.2))
    with pytest.raises(ValueError, match="planner: it sizes the prefill and decode pools"):
        Gateway(ColocatedBackend([object()]), None, GatewayConfig(model_name="m", max_model_len=1024, planner=settings))


def test_info_reports_the_role_and_the_dtype_the_engine_computes_in(model_dir: Path) -> None:
    """What `pdserve serve`'s banner prints: the dtype as the worker resolved it (the tests'
    PDSERVE_DTYPE is float32; `--dtype auto` resolves per device)."""
    backend, services = cluster(model_dir, 1, 1)

    async def main() -> list[Any]:
        try:
            return [await services[name].info() for name in ("p0", "d0")]
        finally:
            await backend.close()

    p0, d0 = asyncio.run(main())
    assert (p0.role, d0.role) == (WorkerRole.PREFILL, WorkerRole.DECODE)
    assert p0.dtype == d0.dtype == "float32" == str(services["d0"].engine.dtype).removeprefix("torch.")


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), -1.0])
def test_a_worker_refuses_a_drain_with_no_deadline(timeout_s: float) -> None:
    """The worker's own `switch_role` (an actor method any caller in the cluster may call, not
    only the gateway, which checks) must refuse a drain that never ends: with an infinite one a
    request that never finished held the worker out of both pools for good ("every wait has a
    deadline", cluster/role_switch.py)."""
    from types import SimpleNamespace

    from pdserve.cluster.role_switch import RoleSwitcher

    engine = SimpleNamespace(num_in_flight=1, refuse_new=lambda why: None)  # a request that never ends
    svc = SimpleNamespace(name="p0", role=SimpleNamespace(role=WorkerRole.PREFILL), async_engine=engine)
    switcher = RoleSwitcher(svc)  # type: ignore[arg-type]

    async def main() -> None:
        with pytest.raises(ValueError, match="drain_timeout_s"):
            await asyncio.wait_for(switcher.switch(WorkerRole.DECODE, timeout_s), timeout=2.0)

    asyncio.run(main())
    assert not switcher.switching
