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

A worker that hangs without dying (SIGSTOP, a step that never returns) fails
nothing by itself: the stall watch (cluster/stall_watch.py) reads the polls, and
a worker that holds work and makes no progress for `stall_timeout_s` is given up:
out of routing, its tries fail with WorkerStalledError (the gateway moves them on
from the tokens their clients have), and Ray restarts it (`ray.kill` with restart
allowed). It is back in its pool once it answers a poll again.

A worker changes pool while it serves (`switch_role`: cluster/role_switch.py has
the worker's side): the router stops routing to it at once, the worker drains
(what is left past the deadline moves to other workers and goes on there), and
it joins the other pool with a fresh load report, so the next request can use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from pdserve.cluster.backend_api import Health, Placement, PoolState, Reliability
from pdserve.cluster.metrics import WorkerHandles
from pdserve.cluster.reports import LoadReport, RoleSwitch
from pdserve.cluster.router import Router
from pdserve.cluster.router.policy import Plan, RoutingDecision, WorkerLoad, WorkerRole
from pdserve.cluster.router.router import RouterStats
from pdserve.cluster.stall_watch import (
    DEFAULT_MAX_TICK_GAP_S,
    DEFAULT_STALL_TIMEOUT_S,
    Stall,
    StallWatch,
    WorkerStalledError,
)
from pdserve.cluster.token_streams import DEFAULT_WORKER_WAIT_S, WORKER_LOST, TokenStreams
from pdserve.cluster.worker_calls import WorkerCalls
from pdserve.cluster.worker_channel import WorkerChannel
from pdserve.cluster.worker_events import Restart, WorkerEvents, restart_actor, restart_soon
from pdserve.cluster.worker_handle import PoolWorkerHandle, abort_try
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
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# A switching worker answers within its drain deadline plus this (the cut, closing
# its links or receiver, emptying its caches, building the other role).
_SWITCH_GRACE_S = 30.0


# A pool: router worker id -> actor handle, None while the worker is not found.
PoolHandles = dict[str, PoolWorkerHandle | None]


class DisaggregatedBackend:
    def __init__(self, prefill: PoolHandles, decode: PoolHandles, router: Router, poll_s: float = 0.25,
                 stream_host: str | None = "127.0.0.1", names: dict[str, str] | None = None,
                 lookup: Callable[[str], PoolWorkerHandle | None] | None = None, max_migrations: int = 2,
                 worker_wait_s: float = DEFAULT_WORKER_WAIT_S, cluster_secret: ClusterSecret | None = None,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, restart: Restart = restart_actor,
                 stream_interval: int = 1) -> None:
        """`prefill`/`decode`: router worker id -> actor handle, or None for a worker
        not found (yet): `lookup(name)` is asked for it again at each poll (a
        gateway that starts while a worker is down). `names`: router worker id ->
        actor name (the `worker` label of its metrics; default the id). `cluster_secret`:
        the workers' (their token streams are signed with it). `stall_timeout_s`: a worker
        that holds work and makes no progress this long is given up and `restart`ed
        (0: never). `stream_interval`: tokens a streamed chunk gathers after the first (the collector's)."""
        self.prefill, self.decode, self.router = prefill, decode, router
        self.names = names or {}
        self.lookup = lookup
        self.streams = TokenStreams(stream_host, max_migrations, worker_wait_s, cluster_secret, stream_interval)
        self.poll_s = poll_s
        self.loads: dict[str, LoadReport] = {}
        self.events = WorkerEvents()
        self._in_flight = 0
        self._dead: set[str] = set()  # taken for alive until a call or a poll fails (`generate` awaits the first poll)
        self._pollers: list[asyncio.Task[None]] = []
        self._polled: set[str] = set()
        self._answered: set[str] = set()  # workers that answered a poll at least once
        self._incarnation: dict[str, str] = {}  # the worker process that last answered
        self._polls_sent: dict[str, int] = {}  # per worker: polls sent (`_refresh_one`)
        self._polls_applied: dict[str, int] = {}  # per worker: the newest poll whose reply was applied
        self._switching: dict[str, PoolWorkerHandle] = {}  # workers changing role: in no pool, routed nothing
        # The latest role change each worker process is known to have made (its incarnation,
        # its count of switches): a report older than that one says nothing of its role.
        self._role_epoch: dict[str, tuple[str, int]] = {}
        self._ready: asyncio.Event | None = None
        self._closing = False
        # The watch ticks at least 4 times per timeout; a tick later than one more second
        # than that means this loop was held up (not counted against the workers).
        self._stall_tick = min(poll_s, stall_timeout_s / 4)
        self.stalls = (StallWatch(stall_timeout_s, max_tick_gap_s=self._stall_tick + DEFAULT_MAX_TICK_GAP_S)
                       if stall_timeout_s else None)
        self._restart = restart
        # Each worker's calls in flight from this gateway's tries (what the stall watch counts and fails).
        self.calls = WorkerCalls()
        self._restarts: set[asyncio.Task[None]] = set()
        self._secret = cluster_secret
        # Each worker's inbox channel (cluster/worker_channel.py), made on its first try; dropped
        # with the handle it was made for.
        self._channels: dict[str, tuple[PoolWorkerHandle, WorkerChannel]] = {}

    @property
    def healthy(self) -> bool:
        return self.health().serving

    def health(self) -> Health:
        pools = {"prefill": self._pool(self.prefill), "decode": self._pool(self.decode)}
        can_prefill = pools["prefill"].live > 0 or self.router.config.fallback_local_prefill or not self.prefill
        return Health(pools, serving=pools["decode"].live > 0 and can_prefill)

    def _pool(self, workers: PoolHandles) -> PoolState:
        return PoolState(sum(w not in self._dead for w in workers), len(workers))

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def pool_split(self) -> tuple[int, int] | None:
        """(prefill, decode) workers answering now; None while a worker changes role (the
        planner loop plans on settled pools only)."""
        if self._switching:
            return None
        return self._pool(self.prefill).live, self._pool(self.decode).live

    def worker_to_move(self, role: WorkerRole) -> str | None:
        """The live worker of the `role` pool with the least work in its last load report:
        the cheapest to drain (None: no live worker there)."""
        pool = self.prefill if role is WorkerRole.PREFILL else self.decode
        live = [w for w, h in pool.items() if h is not None and w not in self._dead]

        def work(wid: str) -> tuple[int, str]:
            load = self.loads.get(wid)
            return (load.snapshot.running + load.snapshot.waiting if load is not None else 0), wid

        return min(live, key=work) if live else None

    def worker_handles(self) -> WorkerHandles:
        pools = [("prefill", self.prefill), ("decode", self.decode)]
        return {self.names.get(wid, wid): (pool, h) for pool, handles in pools for wid, h in handles.items()}

    def router_stats(self) -> RouterStats | None:
        return self.router.stats

    def reliability(self) -> Reliability:
        e = self.events
        return dataclasses.replace(self.streams.reliability(self.health()), workers_lost=e.lost,
                                   workers_readmitted=e.readmitted, workers_restarted=e.restarted,
                                   workers_stalled=e.stalled, role_switches_to_prefill=e.to_prefill,
                                   role_switches_to_decode=e.to_decode,
                                   role_switch_failures=e.switch_failures)

    async def start(self) -> None:
        """Start polling worker loads; returns once every worker answered or failed its first poll."""
        if not self._pollers:
            self._closing = False
            self._ready = asyncio.Event()
            self._pollers = [asyncio.create_task(self._poll(wid, self._ready)) for wid in self._workers()]
            if self.stalls is not None:
                self._pollers.append(asyncio.create_task(self._watch_stalls(self.stalls)))
        assert self._ready is not None
        async with asyncio.timeout(_FIRST_POLL_S):
            await self._ready.wait()

    def stop_all(self) -> None:
        self.streams.stop_all()

    async def close(self) -> None:
        for _, channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        await self.streams.close()
        self._closing = True  # the poll loops check this too: a cancel that lands as a poll returns is not lost
        for task in self._pollers:
            task.cancel()
        for task in self._pollers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pollers = []
        for restart in list(self._restarts):
            with contextlib.suppress(asyncio.CancelledError):
                await restart

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncGenerator[RequestOutput, None]:
        await self.start()
        req = self.streams.request(request_id, prompt, params, timeout_s)
        self._in_flight += 1
        try:
            async with contextlib.aclosing(self.streams.run(req, self._place)) as outs:
                async for out in outs:
                    yield out
        finally:
            self._in_flight -= 1

    def _place(self, req: ServeRequest, failed: Placement | None) -> Placement:
        """Route a try of `req`. A try after a failure is routed without the worker
        that failed; one that resumes a stream computes prompt + output so far on the
        decode worker that goes on with it (no prefill worker: its first token is
        not the request's first)."""
        avoid = None
        if isinstance(failed, _Try):
            if failed.lost is not None:
                self.lose(failed.lost)
            else:  # alive, but the try failed there (its stream lost, its start never taken): elsewhere
                avoid = failed.ran_on
        prompt = list(req.prompt_token_ids) + list(req.resume.token_ids if req.resume is not None else ())
        max_tokens = None if req.params.max_tokens is None else req.params.max_tokens - req.offset
        decision = self.router.route(req.request_id, prompt, max_tokens, req.params.cache_salt, avoid=avoid,
                                     local_only=req.resume is not None)
        # Its try number from the start: an abort that comes before `call` runs (the client gone
        # in the same turn) must name this try, or the worker ignores it and runs the try for no one.
        return _Try(decision, self, self.calls, attempt=req.attempt)

    def channel_of(self, wid: str) -> WorkerChannel:
        """The inbox channel of worker `wid` (found: the router routes only to workers that answered)."""
        handle = self.handle_of(wid)
        if handle is None:
            raise LookupError(f"worker {wid!r}: routed before it was found")
        held = self._channels.get(wid)
        if held is None or held[0] is not handle:
            if held is not None:
                held[1].discard()  # a restarted worker's new handle: the old one's tries failed with it
            held = self._channels[wid] = (handle, WorkerChannel(handle, self.streams.collector.address,
                                                                self._secret))
        return held[1]

    def finished(self, request_id: str) -> asyncio.Event:
        """Set once the request's final delta was handed on (the collector's)."""
        return self.streams.collector.finished(request_id)

    def abort_on(self, wid: str, request_id: str, attempt: int) -> None:
        """Tell worker `wid` to drop try `attempt` of a request (fire and forget): on its inbox,
        after the start; by a Ray call where its channel is down or was never made."""
        held = self._channels.get(wid)
        if held is None or not held[1].abort(request_id, attempt):
            abort_try(self.handle_of(wid), request_id, attempt)

    def lose(self, wid: str) -> None:
        """`wid` failed a call or a poll: out of routing until it answers a poll sent from now on."""
        # A poll in flight was answered, if at all, before the loss: its reply would put a dead
        # worker back into routing. Taking a number makes every poll sent so far an old one.
        self._polls_applied[wid] = self._polls_sent[wid] = self._polls_sent.get(wid, 0) + 1
        if wid not in self._dead:
            self._dead.add(wid)
            self.events.lost += wid in self._answered
        role = self._role(wid)
        if role is not None:  # a switching worker is out of routing already
            self.router.update_load(WorkerLoad(wid, role, healthy=False))

    def _workers(self) -> list[str]:
        return [*self.prefill, *self.decode, *self._switching]

    def _role(self, wid: str) -> WorkerRole | None:
        """The pool `wid` is in (None: it is changing role)."""
        return WorkerRole.PREFILL if wid in self.prefill else WorkerRole.DECODE if wid in self.decode else None

    def worker_id(self, worker: str) -> str:
        """The router id of `worker`, given its id or its actor name (ValueError: neither)."""
        if worker in self._workers():
            return worker
        ids = [wid for wid, name in self.names.items() if name == worker]
        if not ids:
            raise ValueError(f"worker: no worker named {worker!r}")
        return ids[0]

    def handle_of(self, wid: str) -> PoolWorkerHandle | None:
        """The worker's actor handle, whichever pool it is in (a try routed before a
        switch still calls and aborts on it); None while the worker is not found."""
        for pool in (self.prefill, self.decode, self._switching):
            if wid in pool:
                return pool[wid]
        raise LookupError(f"worker {wid!r} is not in this deployment")

    # -- role switches -------------------------------------------------------------

    async def switch_role(self, wid: str, role: WorkerRole,
                          drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> RoleSwitch:
        """Move worker `wid` into the `role` pool while the cluster serves. The router
        stops routing to it at once and forgets its cache; the worker drains for up to
        `drain_timeout_s`, and what it still holds then moves to other workers (the
        gateway's migration: the clients' streams go on); it joins the other pool, and
        the router learns its new role and load before this returns.

        ValueError (nothing changed but the router's view of its cache, which its next
        poll brings back): a role other than prefill or decode, a drain timeout that is no
        finite number >= 0, an unknown worker or one in that pool already, a switch of it
        under way (here or, as the worker answers, from another replica), or a pool it would
        leave with no live worker; a refusal is no failed switch. If the worker fails the
        switch or does not answer in time, it stays out of routing until a poll says which
        role it holds."""
        if not (isinstance(drain_timeout_s, (int, float)) and math.isfinite(drain_timeout_s)
                and drain_timeout_s >= 0):
            raise ValueError(f"drain_timeout_s: must be a finite number >= 0, got {drain_timeout_s!r}")
        if role not in (WorkerRole.PREFILL, WorkerRole.DECODE):
            raise ValueError(f"role: a worker switches to prefill or decode, got {role.value}")
        if wid in self._switching:
            raise ValueError(f"worker {wid}: a role switch is under way")
        src, dst = (self.decode, self.prefill) if role is WorkerRole.PREFILL else (self.prefill, self.decode)
        old = WorkerRole.DECODE if role is WorkerRole.PREFILL else WorkerRole.PREFILL
        if wid not in src:
            raise ValueError(f"worker {wid}: a {role.value} worker already" if wid in dst
                             else f"worker: no worker {wid!r}")
        handle = src[wid]
        if handle is None or wid in self._dead:
            raise ValueError(f"worker {wid}: not answering; it cannot switch now")
        if not any(w != wid and w not in self._dead and h is not None for w, h in src.items()):
            raise ValueError(f"worker {wid}: the {old.value} pool would be left with no live worker")
        del src[wid]
        self._switching[wid] = handle
        self.router.update_load(WorkerLoad(wid, old, healthy=False))  # routed nothing from now on
        self.router.forget_cache(wid)
        try:
            async with asyncio.timeout(drain_timeout_s + _SWITCH_GRACE_S):
                result: RoleSwitch = await handle.switch_role.remote(role, drain_timeout_s)
        except BaseException as e:
            src[wid] = handle  # where it was; its next poll says which role it holds (`_follow`)
            del self._switching[wid]
            if not isinstance(e, ValueError):  # the worker refused it (ValueError): nothing failed
                self.events.switch_failures += 1
                self.lose(wid)
            raise
        del self._switching[wid]
        dst[wid] = handle
        self._role_epoch[wid] = (result.incarnation, result.epoch)
        self.router.forget_cache(wid)  # its prefix cache was emptied: nothing of it is left there
        if role is WorkerRole.PREFILL:
            self.events.to_prefill += 1
        else:
            self.events.to_decode += 1
        await self._refresh_one(wid)  # the router routes to it in its new role from the next request on
        log.info("worker %s: %s -> %s (%d drained, %d moved on, %.2f s)", wid, old.value, role.value,
                 result.drained, result.migrated, result.duration_s)
        return result

    def _follow(self, wid: str, report: LoadReport) -> None:
        """A report newer than any switch of the worker we know of, of a role other than
        its pool's (another gateway switched it, a switch of ours failed half way, or Ray
        restarted it in the role it was created with): move it where it says it is."""
        role, known = report.role, self._role_epoch.get(wid)
        if role is None or wid in self._switching or report.switching:
            return
        if known is not None and known[0] == report.incarnation and report.role_epoch <= known[1]:
            return  # sent before a switch we know of (replies may overtake each other)
        self._role_epoch[wid] = (report.incarnation, report.role_epoch)
        src, dst = (self.decode, self.prefill) if role is WorkerRole.PREFILL else (self.prefill, self.decode)
        if wid in src:
            log.warning("worker %s reports the %s role: moving it to that pool", wid, role.value)
            dst[wid] = src.pop(wid)
            self.router.forget_cache(wid)

    # -- loads and KV events -----------------------------------------------------

    async def _poll(self, wid: str, ready: asyncio.Event) -> None:
        """One worker's poll loop (each worker has its own: one that hangs or
        restarts for a minute does not hold the others' reports)."""
        while not self._closing:
            try:
                await self._refresh_one(wid)
            except Exception:  # noqa: BLE001 - a bug in handling one report must not end the loop for good
                log.exception("poll of worker %s failed", wid)
                self.lose(wid)
            self._polled.add(wid)
            if self._polled.issuperset(self._workers()):
                ready.set()
            await asyncio.sleep(self.poll_s)

    async def _refresh(self) -> None:
        """Poll every worker once (tests; the poll loops do it continually)."""
        await asyncio.gather(*(self._refresh_one(wid) for wid in self._workers()))

    async def _refresh_one(self, wid: str) -> None:
        # Polls of one worker are numbered as they are sent: with two in flight (the poll loop, a
        # role switch's refresh) a reply older than one applied is dropped whole. Applied, a late
        # snapshot of a worker's previous life replaced its new life's cache, load and incarnation.
        sent = self._polls_sent[wid] = self._polls_sent.get(wid, 0) + 1
        handle = await self._handle(wid)
        try:
            if handle is None:
                raise LookupError(f"worker {wid} not found")
            forgets = self.router.kv_forgets(wid)  # the view this poll's events go on from
            async with asyncio.timeout(_POLL_TIMEOUT_S):
                report: LoadReport = await handle.load.remote(self.router.kv_cursor(wid))
            if sent < self._polls_applied.get(wid, 0):
                return
            self._polls_applied[wid] = sent
        except Exception as e:  # noqa: BLE001 - dead, hung, restarting, or its engine failed: not routable
            self.lose(wid)
            if self.stalls is not None and not isinstance(e, TimeoutError):
                self.stalls.forget(wid, time.monotonic())  # it died (Ray restarts it): no hang to watch for
            return
        if self.stalls is not None:
            self.stalls.answered(wid, time.monotonic(), report.snapshot)
        if wid in self._dead:
            self._dead.discard(wid)  # it answers: routable again (a restarted worker, a hiccup)
            self.events.readmitted += wid in self._answered
        self._answered.add(wid)
        if self._incarnation.setdefault(wid, report.incarnation) != report.incarnation:
            self._incarnation[wid] = report.incarnation
            self.events.restarted += 1
        self.loads[wid] = report
        self._apply_events(wid, report.events, forgets)
        self._follow(wid, report)
        role = self._role(wid)
        if role is None:
            return  # changing role here: routed nothing until the switch is over
        s = report.snapshot
        healthy = not report.switching  # another gateway is switching it
        # Its requests: those running and those waiting (a decode worker's handoffs whose KV has not
        # landed wait, as do queued prompts): counting the running alone, one holding 8 handoffs looked idle.
        self.router.update_load(WorkerLoad(wid, role, healthy=healthy, queued_prefill_tokens=s.queued_prefill_tokens,
                                           running_requests=s.running + s.waiting, free_blocks=s.free_blocks,
                                           total_blocks=s.total_blocks))

    async def _handle(self, wid: str) -> PoolWorkerHandle | None:
        if wid in self._switching:
            return self._switching[wid]
        pool = self.prefill if wid in self.prefill else self.decode
        if pool[wid] is None and self.lookup is not None:
            pool[wid] = await asyncio.to_thread(self.lookup, self.names.get(wid, wid))
        return pool[wid]

    def _apply_events(self, wid: str, batch: KVEventBatch, forgets: int) -> None:
        """The worker answered from the cursor the router gave (or with a snapshot, where
        its log no longer holds that, or it restarted): nothing is drained, so every
        gateway replica polling it ends with the same view (workers/kv/event_log.py)."""
        self.router.on_kv_batch(wid, batch, forgets)

    # -- stalls ----------------------------------------------------------------------

    async def _watch_stalls(self, watch: StallWatch) -> None:
        """Every tick, give up the workers the stall watch says are stalled. Its own
        task: a stopped worker's poll waits `_POLL_TIMEOUT_S` for an answer."""
        while not self._closing:
            tries = self.calls.counts()
            pools = [*self.prefill, *self.decode]  # not a switching worker: its drain has its own deadline
            for stall in watch.check(time.monotonic(), tries, pools):
                self._give_up(stall)
            await asyncio.sleep(self._stall_tick)

    def _give_up(self, stall: Stall) -> None:
        """Take the stalled worker for dead: out of routing, its tries moved on, restarted."""
        wid = stall.worker
        log.warning("worker %s stalled (%s): moving its requests and restarting it", wid, stall.reason)
        self.events.stalled += 1
        self.lose(wid)
        self.calls.give_up(wid, lambda: WorkerStalledError(f"worker {wid} stalled: {stall.reason}"))
        handle = self.handle_of(wid)
        if handle is not None:
            restart_soon(self._restart, wid, handle, self._restarts)


@dataclass(eq=False)
class _Try:
    """One try of a request, by its routing decision: the start that runs it, on its worker's
    inbox. The backend gives it the workers' channels, and `calls` is where the stall watch
    fails the tries of a worker it gives up; a prefill worker found dead on the way is taken
    out of routing (`lose`)."""

    decision: RoutingDecision
    backend: DisaggregatedBackend
    calls: WorkerCalls
    lost: str | None = None  # the worker whose death ended this try
    attempt: int = 0

    async def call(self, req: ServeRequest) -> None:
        d, b = self.decision, self.backend
        self.attempt = req.attempt
        w, p_id = d.decode_worker, d.prefill_worker
        done = b.finished(req.request_id)
        try:
            if d.plan is Plan.LOCAL or p_id is None:
                await self.calls.run(w, b.channel_of(w).run(req, done))
            elif d.plan is Plan.HANDOFF:
                peer = (p_id, self._routed(p_id))
                await self.calls.run(w, b.channel_of(w).run(req, done, prefill=peer))
            else:
                try:
                    await self.calls.run(p_id, b.channel_of(p_id).run(req, done))
                except WORKER_LOST:  # it is gone: the decode worker runs the request
                    b.lose(p_id)
                    await self.calls.run(w, b.channel_of(w).run(req, done))
        except WORKER_LOST:
            self.lost = w
            raise

    @property
    def ran_on(self) -> str:
        """The worker whose inbox the try was started on (a prefill-only try's prefill worker)."""
        d = self.decision
        if d.plan is Plan.PREFILL_ONLY and d.prefill_worker is not None:
            return d.prefill_worker
        return d.decode_worker

    def _routed(self, wid: str) -> PoolWorkerHandle:
        """The handle of a worker this try was routed to: found, as the router knows a
        worker only once it has answered a poll."""
        handle = self.backend.handle_of(wid)
        if handle is None:
            raise LookupError(f"worker {wid!r}: routed before it was found")
        return handle

    def abort(self, request_id: str) -> None:
        d = self.decision
        self.backend.abort_on(d.decode_worker, request_id, self.attempt)
        if d.prefill_worker is not None:
            self.backend.abort_on(d.prefill_worker, request_id, self.attempt)
