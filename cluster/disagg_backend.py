"""The gateway's coordinator for disaggregated serving.

One request: the router picks a prefill and a decode worker and a plan; one
call runs it, and every token comes back on the gateway's token stream:

    LOCAL         decode.serve(req)                      the decode worker prefills it too
    HANDOFF       decode.handoff(req, prefill)           it reserves blocks, the prefill worker
                                                         computes the prompt into them, it decodes
    PREFILL_ONLY  prefill.serve(req)                     ends at its first token: no decode worker
                                                         (if the prefill worker is gone: decode.serve)

Any exit before the end (client gone, deadline, worker error) aborts the
request on both workers, which frees its blocks on both sides. Worker loads and
KV events reach the router from a poller every `poll_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pdserve.cluster.backend import (
    DEFAULT_WORKER_WAIT_S,
    WORKER_LOST,
    Health,
    Placement,
    PoolState,
    Reliability,
    TokenStreams,
    _abort,
)
from pdserve.cluster.metrics import WorkerHandles
from pdserve.cluster.reports import LoadReport
from pdserve.cluster.router import Router
from pdserve.cluster.router.policy import Plan, RoutingDecision, WorkerLoad, WorkerRole
from pdserve.cluster.router.router import RouterStats
from pdserve.workers.handoff import ServeRequest
from pdserve.workers.messages import KVEventBatch
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.transfer.auth import ClusterSecret

log = logging.getLogger(__name__)

# The router knows no worker until the first poll has answered; a worker that
# takes longer than this to report is taken for dead (until it answers again).
_FIRST_POLL_S = 30.0
_POLL_TIMEOUT_S = 5.0


@dataclass
class WorkerEvents:
    """Counts of what the poller saw happen to workers (exported by the gateway)."""

    lost: int = 0  # a worker went from answering to not (its call or its poll failed)
    readmitted: int = 0  # a lost worker answered again (restarted, or a hiccup over)
    restarted: int = 0  # a worker answered from a new process (Ray restarted it)


class DisaggregatedBackend:
    def __init__(self, prefill: dict[str, Any], decode: dict[str, Any], router: Router, poll_s: float = 0.05,
                 stream_host: str | None = "127.0.0.1", names: dict[str, str] | None = None,
                 lookup: Callable[[str], Any | None] | None = None, max_migrations: int = 2,
                 worker_wait_s: float = DEFAULT_WORKER_WAIT_S, cluster_secret: ClusterSecret | None = None) -> None:
        """`prefill`/`decode`: router worker id -> actor handle, or None for a worker
        not found (yet): `lookup(name)` is asked for it again at each poll (a
        gateway that starts while a worker is down). `names`: router worker id ->
        actor name (the `worker` label of its metrics; default the id). `cluster_secret`:
        the workers' (their token streams are signed with it)."""
        self.prefill, self.decode, self.router = prefill, decode, router
        self.names = names or {}
        self.lookup = lookup
        self.streams = TokenStreams(stream_host, max_migrations, worker_wait_s, cluster_secret)
        self.poll_s = poll_s
        self.loads: dict[str, LoadReport] = {}
        self.events = WorkerEvents()
        self._in_flight = 0
        self._dead: set[str] = set()  # taken for alive until a call or a poll fails (`generate` awaits the first poll)
        self._event_seq: dict[str, int] = {}  # the next KV event batch each worker should send
        self._pollers: list[asyncio.Task[None]] = []
        self._polled: set[str] = set()
        self._answered: set[str] = set()  # workers that answered a poll at least once
        self._incarnation: dict[str, str] = {}  # the worker process that last answered
        self._ready: asyncio.Event | None = None
        self._closing = False

    @property
    def healthy(self) -> bool:
        return self.health().serving

    def health(self) -> Health:
        pools = {"prefill": self._pool(self.prefill), "decode": self._pool(self.decode)}
        can_prefill = pools["prefill"].live > 0 or self.router.config.fallback_local_prefill or not self.prefill
        return Health(pools, serving=pools["decode"].live > 0 and can_prefill)

    def _pool(self, workers: dict[str, Any]) -> PoolState:
        return PoolState(sum(w not in self._dead for w in workers), len(workers))

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def worker_handles(self) -> WorkerHandles:
        pools = [("prefill", self.prefill), ("decode", self.decode)]
        return {self.names.get(wid, wid): (pool, h) for pool, handles in pools for wid, h in handles.items()
                if h is not None}

    def router_stats(self) -> RouterStats | None:
        return self.router.stats

    def reliability(self) -> Reliability:
        e = self.events
        return dataclasses.replace(self.streams.reliability(self.health()), workers_lost=e.lost,
                                   workers_readmitted=e.readmitted, workers_restarted=e.restarted)

    async def start(self) -> None:
        """Start polling worker loads; returns once every worker answered or failed its first poll."""
        if not self._pollers:
            self._closing = False
            self._ready = asyncio.Event()
            roles = {**dict.fromkeys(self.prefill, WorkerRole.PREFILL), **dict.fromkeys(self.decode, WorkerRole.DECODE)}
            self._pollers = [asyncio.create_task(self._poll(wid, role, self._ready)) for wid, role in roles.items()]
        assert self._ready is not None
        await asyncio.wait_for(self._ready.wait(), timeout=_FIRST_POLL_S)

    async def close(self) -> None:
        await self.streams.close()
        self._closing = True  # Python 3.11's wait_for can swallow a cancel: the poll loops check this too
        for task in self._pollers:
            task.cancel()
        for task in self._pollers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pollers = []

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        await self.start()
        req = self.streams.request(request_id, prompt, params, timeout_s)
        self._in_flight += 1
        try:
            async for out in self.streams.run(req, self._place):
                yield out
        finally:
            self._in_flight -= 1

    def _place(self, req: ServeRequest, failed: Placement | None) -> Placement:
        """Route a try of `req`. A try after a failure is routed without the worker
        that failed; one that resumes a stream computes prompt + output so far on the
        decode worker that goes on with it (no prefill worker: its first token is
        not the request's first)."""
        if isinstance(failed, _Try) and failed.lost is not None:
            self._lose(failed.lost)
        prompt = list(req.prompt_token_ids) + list(req.resume.token_ids if req.resume is not None else ())
        max_tokens = None if req.params.max_tokens is None else req.params.max_tokens - req.offset
        decision = self.router.route(req.request_id, prompt, max_tokens, req.params.cache_salt)
        if req.resume is not None and decision.plan is not Plan.LOCAL:
            decision = dataclasses.replace(decision, plan=Plan.LOCAL, prefill_worker=None)
        return _Try(self, decision)

    def _lose(self, wid: str) -> None:
        """`wid` failed a call or a poll: out of routing until it answers a poll again."""
        if wid not in self._dead:
            self._dead.add(wid)
            self.events.lost += wid in self._answered
        role = WorkerRole.PREFILL if wid in self.prefill else WorkerRole.DECODE
        self.router.update_load(WorkerLoad(wid, role, healthy=False))

    # -- loads and KV events -----------------------------------------------------

    async def _poll(self, wid: str, role: WorkerRole, ready: asyncio.Event) -> None:
        """One worker's poll loop (each worker has its own: one that hangs or
        restarts for a minute does not hold the others' reports)."""
        while not self._closing:
            try:
                await self._refresh_one(wid, role)
            except Exception:  # noqa: BLE001 - a bug in handling one report must not end the loop for good
                log.exception("poll of worker %s failed", wid)
                self._lose(wid)
            self._polled.add(wid)
            if len(self._polled) == len(self.prefill) + len(self.decode):
                ready.set()
            await asyncio.sleep(self.poll_s)

    async def _refresh(self) -> None:
        """Poll every worker once (tests; the poll loops do it continually)."""
        roles = {**dict.fromkeys(self.prefill, WorkerRole.PREFILL), **dict.fromkeys(self.decode, WorkerRole.DECODE)}
        await asyncio.gather(*(self._refresh_one(wid, role) for wid, role in roles.items()))

    async def _refresh_one(self, wid: str, role: WorkerRole) -> None:
        handle = await self._handle(wid)
        try:
            if handle is None:
                raise LookupError(f"worker {wid} not found")
            report: LoadReport = await asyncio.wait_for(handle.load.remote(), timeout=_POLL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - dead, hung, restarting, or its engine failed: not routable
            self._lose(wid)
            return
        if wid in self._dead:
            self._dead.discard(wid)  # it answers: routable again (a restarted worker, a hiccup)
            self.events.readmitted += wid in self._answered
        self._answered.add(wid)
        if self._incarnation.setdefault(wid, report.incarnation) != report.incarnation:
            self._incarnation[wid] = report.incarnation
            self.events.restarted += 1
        self.loads[wid] = report
        self._apply_events(wid, report.events)
        s = report.snapshot
        self.router.update_load(WorkerLoad(wid, role, healthy=True, queued_prefill_tokens=s.queued_prefill_tokens,
                                           running_requests=s.running, free_blocks=s.free_blocks,
                                           total_blocks=s.total_blocks))

    async def _handle(self, wid: str) -> Any | None:
        pool = self.prefill if wid in self.prefill else self.decode
        if pool[wid] is None and self.lookup is not None:
            pool[wid] = await asyncio.to_thread(self.lookup, self.names.get(wid, wid))
        return pool[wid]

    def _apply_events(self, wid: str, batch: KVEventBatch) -> None:
        if batch.batch_seq != self._event_seq.get(wid, 0):
            self.router.forget_cache(wid)  # a batch was lost (or the worker restarted): relearn what it caches
        self._event_seq[wid] = batch.batch_seq + 1
        self.router.on_kv_events(wid, batch.events)


@dataclass(eq=False)
class _Try:
    """One try of a request, by its routing decision: the one call that runs it."""

    backend: DisaggregatedBackend
    decision: RoutingDecision
    lost: str | None = None  # the worker whose death ended this try
    attempt: int = 0

    async def call(self, req: ServeRequest) -> None:
        b, d = self.backend, self.decision
        self.attempt = req.attempt
        decode, p_id = b.decode[d.decode_worker], d.prefill_worker
        try:
            if d.plan is Plan.LOCAL or p_id is None:
                await decode.serve.remote(req)
            elif d.plan is Plan.HANDOFF:
                await decode.handoff.remote(req, b.prefill[p_id])
            else:
                try:
                    await b.prefill[p_id].serve.remote(req)
                except WORKER_LOST:  # it is gone: the decode worker runs the request
                    b._lose(p_id)
                    await decode.serve.remote(req)
        except WORKER_LOST:
            self.lost = d.decode_worker
            raise

    def abort(self, request_id: str) -> None:
        b, d = self.backend, self.decision
        _abort(b.decode[d.decode_worker], request_id, self.attempt)
        if d.prefill_worker is not None:
            _abort(b.prefill[d.prefill_worker], request_id, self.attempt)
