"""What gateway replicas share and the routing state: faults a review found, each test
failing before its fix (the docstrings say what was wrong)."""

from __future__ import annotations

import asyncio

from factories import LocalActor

from pdserve import SamplingParams
from pdserve.cluster.disagg_backend import DisaggregatedBackend
from pdserve.cluster.reports import LoadReport
from pdserve.cluster.router import Router
from pdserve.cluster.router.policy import DecodeReason, Plan, RouterConfig, RoutingPolicy, WorkerLoad, WorkerRole
from pdserve.workers.handoff import Resume, ServeRequest
from pdserve.workers.kv.block_pool import BlockPool
from pdserve.workers.messages import KVEventBatch
from pdserve.workers.stats import EngineSnapshot

BS = 16
GATEWAY = "tcp://127.0.0.1:5999"


class _FakeWorker:
    """A worker service whose load report is what the test sets (no KV events: an empty
    snapshot of a pool that records none)."""

    def __init__(self, name: str, role: WorkerRole, snapshot: EngineSnapshot, incarnation: str = "i1") -> None:
        self.name, self.role, self.snapshot, self.incarnation = name, role, snapshot, incarnation

    async def load(self, since: object = None) -> LoadReport:
        events = KVEventBatch(worker_id=self.name, log_id="", first_seq=0, next_seq=0, snapshot=True, events=())
        return LoadReport(self.snapshot, events, self.incarnation, self.role)


def _snap(running: int = 0, waiting: int = 0, queued: int = 0, free: int = 1000) -> EngineSnapshot:
    return EngineSnapshot(running=running, waiting=waiting, queued_prefill_tokens=queued, free_blocks=free,
                          total_blocks=1000)


def _backend(prefill: dict[str, EngineSnapshot], decode: dict[str, EngineSnapshot],
             config: RouterConfig | None = None) -> DisaggregatedBackend:
    return DisaggregatedBackend(
        {w: LocalActor(_FakeWorker(w, WorkerRole.PREFILL, s)) for w, s in prefill.items()},
        {w: LocalActor(_FakeWorker(w, WorkerRole.DECODE, s)) for w, s in decode.items()},
        Router(config or RouterConfig(), BS), stall_timeout_s=0)


# -- 1. decode load leaves out the requests waiting on the decode worker ------------------


def test_decode_worker_with_requests_awaiting_kv_is_not_taken_for_idle() -> None:
    """d0 holds 8 handoffs whose KV has not arrived (EngineSnapshot.waiting) and runs none;
    d1 runs 3. The poller hands the router `running_requests=s.running` only, so d0 looks
    idle and gets the next request too; the planner's simulator (and docs/planner.md) count
    running + awaiting, which picks d1."""
    backend = _backend({"p0": _snap()}, {"d0": _snap(running=0, waiting=8), "d1": _snap(running=3)})

    async def main() -> None:
        await backend._refresh()
        d = backend.router.route("r", list(range(1, 200)), 16)
        assert d.decode_worker == "d1", (d.decode_worker, backend.router.loads["d0"])

    asyncio.run(main())


# -- 2. a resumed request is accounted (and counted) as the plan it does not run -------------


def test_resumed_try_charges_the_decode_worker_not_a_prefill_worker_it_never_uses() -> None:
    """A migrated request resumes LOCAL on its decode worker (`_place` rewrites the plan after
    `Router.route`), but the router charged and counted the HANDOFF it decided: the prefill
    worker's queue grows by the whole prompt until its next report, the decode worker that
    really prefills is charged nothing for it, and `transferred_blocks` (an exported
    counter) counts blocks that never move."""
    backend = _backend({"p0": _snap()}, {"d0": _snap()})
    prompt = tuple(range(1, 321))  # 20 blocks, cached nowhere
    req = ServeRequest("r", prompt, SamplingParams(max_tokens=64), 30.0, GATEWAY, attempt=1,
                       resume=Resume((7, 8, 9), 3))

    async def main() -> None:
        await backend._refresh()
        try_ = backend._place(req, None)
        assert try_.decision.plan is Plan.LOCAL and try_.decision.prefill_worker is None
        loads, stats = backend.router.loads, backend.router.stats
        assert (loads["p0"].queued_prefill_tokens, stats.transferred_blocks) == (0, 0), \
            (loads["p0"].queued_prefill_tokens, stats.transferred_blocks, dict(stats.decisions))
        assert loads["d0"].queued_prefill_tokens >= len(prompt)

    asyncio.run(main())


# -- 3. round robin: every replica starts its cycle at the same worker -----------------------


def test_round_robin_replicas_do_not_all_start_on_the_same_workers() -> None:
    """Two gateway replicas' routers (built alike by serve_app._disaggregated_backend: no rank)
    each route one request with the round-robin policy: both go to p0/d0 while p1/d1 sit idle,
    and the replicas' counters go on in step. ColocatedBackend starts replica r of N at worker
    r x workers / N for this very reason (docs/cluster.md); the disaggregated router does not."""
    config = RouterConfig(policy=RoutingPolicy.ROUND_ROBIN, local_prefill_threshold_tokens=0)
    loads = [WorkerLoad("p0", WorkerRole.PREFILL, free_blocks=100, total_blocks=100),
             WorkerLoad("p1", WorkerRole.PREFILL, free_blocks=100, total_blocks=100),
             WorkerLoad("d0", WorkerRole.DECODE, free_blocks=100, total_blocks=100),
             WorkerLoad("d1", WorkerRole.DECODE, free_blocks=100, total_blocks=100)]
    replicas = [Router(config, BS, replica=(0, 2)), Router(config, BS, replica=(1, 2))]
    for router in replicas:
        for load in loads:
            router.update_load(load)
    picks = [r.route(f"r{i}", list(range(1, 100)), 16) for i, r in enumerate(replicas)]
    assert {d.decode_worker for d in picks} == {"d0", "d1"}, [(d.prefill_worker, d.decode_worker) for d in picks]


# -- 4. a snapshot of a worker's previous life undoes the view of its new life --------------


class _Restarting(_FakeWorker):
    """A worker whose first poll is answered late, by its previous life (block 111), after its
    new life (block 222) answered the second."""

    def __init__(self) -> None:
        super().__init__("p0", WorkerRole.PREFILL, _snap())
        self.old, self.new = BlockPool(8, record_events=True), BlockPool(8, record_events=True)
        (b,) = self.old.allocate(1)
        self.old.cache(b, 111, None)
        (b,) = self.new.allocate(1)
        self.new.cache(b, 222, None)
        self.release = asyncio.Event()
        self.calls = 0

    async def load(self, since: object = None) -> LoadReport:
        self.calls += 1
        if self.calls == 1:
            await self.release.wait()
            return LoadReport(self.snapshot, KVEventBatch.of("p0", self.old.read_events(None)), "old", self.role)
        return LoadReport(self.snapshot, KVEventBatch.of("p0", self.new.read_events(None)), "new", self.role)


def test_snapshot_from_a_workers_previous_life_does_not_replace_its_new_life() -> None:
    """Two polls of one worker in flight (the poll loop and a role switch's refresh) across a
    restart: the new life's reply is applied, then the old life's late one came and replaced
    its blocks, cursor and incarnation (the backend counted a second restart). Replies older
    than one applied are dropped now."""
    worker = _Restarting()
    backend = DisaggregatedBackend({"p0": LocalActor(worker)}, {"d0": LocalActor(_FakeWorker("d0", WorkerRole.DECODE,
                                                                                             _snap()))},
                                   Router(RouterConfig(), BS), stall_timeout_s=0)

    async def main() -> None:
        first = asyncio.ensure_future(backend._refresh_one("p0"))
        await asyncio.sleep(0.01)
        await backend._refresh_one("p0")  # the new life answers
        assert backend.router.index.blocks("p0") == {222}
        worker.release.set()
        await first  # the old life's late reply
        assert backend.router.index.blocks("p0") == {222}, backend.router.index.blocks("p0")
        assert backend._incarnation["p0"] == "new" and backend.events.restarted == 0

    asyncio.run(main())


def test_cache_aware_replicas_break_ties_of_short_prompts_on_different_workers() -> None:
    """The same with the cache-aware policy for prompts shorter than a block (no affinity key:
    `tie_rank` falls back to the worker id): one replica spreads two such requests over d0 and
    d1 (its own charge breaks the tie), two replicas with one request each both pick d0."""
    loads = [WorkerLoad("p0", WorkerRole.PREFILL, free_blocks=100, total_blocks=100),
             WorkerLoad("d0", WorkerRole.DECODE, free_blocks=100, total_blocks=100),
             WorkerLoad("d1", WorkerRole.DECODE, free_blocks=100, total_blocks=100)]
    replicas = [Router(RouterConfig(), BS, replica=(0, 2)), Router(RouterConfig(), BS, replica=(1, 2))]
    for router in replicas:
        for load in loads:
            router.update_load(load)
    picks = [r.route(f"r{i}", list(range(1, 11)), 16).decode_worker for i, r in enumerate(replicas)]
    assert set(picks) == {"d0", "d1"}, picks


# -- 5. a poll answered before a worker was lost readmits it --------------------------------


class _LateAnswer(_FakeWorker):
    """A worker whose first poll is answered (healthy, idle) only when the test says: a reply
    written before the worker died that reaches the gateway after a call found it gone."""

    def __init__(self, name: str) -> None:
        super().__init__(name, WorkerRole.DECODE, _snap())
        self.release = asyncio.Event()
        self.calls = 0

    async def load(self, since: object = None) -> LoadReport:
        self.calls += 1
        if self.calls == 1:
            await self.release.wait()
        return await super().load(since)


def test_a_poll_sent_before_a_worker_was_lost_does_not_readmit_it() -> None:
    """A call on d1 fails with the worker lost (`lose`) while a poll of it is in flight; the
    poll's reply, written before the loss, came after it and put d1 back into routing: the
    next requests were routed to a dead worker, each costing a migration. Replies to polls
    sent before a loss are dropped now; a poll sent after it readmits the worker as before."""
    late = _LateAnswer("d1")
    backend = DisaggregatedBackend({"p0": LocalActor(_FakeWorker("p0", WorkerRole.PREFILL, _snap()))},
                                   {"d0": LocalActor(_FakeWorker("d0", WorkerRole.DECODE, _snap())),
                                    "d1": LocalActor(late)},
                                   Router(RouterConfig(policy=RoutingPolicy.ROUND_ROBIN), BS), stall_timeout_s=0)

    def decode_picks() -> set[str]:
        return {backend.router.route(f"r{i}", list(range(1, 40)), 16).decode_worker for i in range(6)}

    async def main() -> None:
        await backend._refresh_one("p0")
        await backend._refresh_one("d0")
        in_flight = asyncio.ensure_future(backend._refresh_one("d1"))
        await asyncio.sleep(0.01)
        backend.lose("d1")  # a call on it failed: the worker is gone
        late.release.set()
        await in_flight
        assert decode_picks() == {"d0"}
        await backend._refresh_one("d1")  # a poll after the loss that it answers: back in routing
        assert decode_picks() == {"d0", "d1"}

    asyncio.run(main())


def test_replicas_spread_requests_no_decode_worker_has_room_for() -> None:
    """With no decode worker room for the prompt (NO_ROOM), ties between equally full
    workers went by id: every gateway replica sent its overflow to d0 while d1, as full,
    got none. They break as the other decode ties do now (`tie_rank`)."""
    config = RouterConfig(local_prefill_threshold_tokens=0)
    loads = [WorkerLoad("p0", WorkerRole.PREFILL, free_blocks=100, total_blocks=100),
             WorkerLoad("d0", WorkerRole.DECODE, free_blocks=0, total_blocks=100),
             WorkerLoad("d1", WorkerRole.DECODE, free_blocks=0, total_blocks=100)]
    replicas = [Router(config, BS, replica=(0, 2)), Router(config, BS, replica=(1, 2))]
    for router in replicas:
        for load in loads:
            router.update_load(load)
    picks = [r.route(f"r{i}", list(range(1, 11)), 16) for i, r in enumerate(replicas)]
    assert all(p.decode_reason is DecodeReason.NO_ROOM for p in picks), [p.decode_reason for p in picks]
    assert {p.decode_worker for p in picks} == {"d0", "d1"}, [p.decode_worker for p in picks]
