"""The gateway's view of its workers: a `GenerationBackend` runs a request and
yields its DELTA outputs.

Every backend runs a request the same way: one message to a worker's inbox
starts it (`ServeRequest`, with this gateway's token stream as `reply_to`:
cluster/worker_channel.py), and every token, the first included, comes back on
that stream (`TokenStreams.run`); its error, or the worker's death, on the
channel's long poll.
The request's gateway-side lifecycle ends with the stream; any end but its
finish aborts it on its workers, which frees its blocks there.
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
from typing import Protocol, TypedDict

from pdserve.cluster.colocated_watch import ColocatedWatch
from pdserve.cluster.metrics import WorkerHandles
from pdserve.cluster.placement import bind_host
from pdserve.cluster.ray_errors import RayActorError
from pdserve.cluster.router.policy import NoHealthyWorkerError
from pdserve.cluster.router.router import RouterStats
from pdserve.cluster.token_collector import TokenStreamCollector
from pdserve.cluster.worker_channel import WorkerChannel
from pdserve.cluster.worker_events import Restart, restart_actor
from pdserve.cluster.worker_handle import WorkerHandle, abort_try
from pdserve.workers.async_engine import AsyncEngine, EngineDeadError, RequestFaultError, WorkerDrainingError
from pdserve.workers.handoff import ServeRequest
from pdserve.workers.lifecycle import Exit
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.token_stream import StreamLostError
from pdserve.workers.transfer.auth import ClusterSecret

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolState:
    live: int  # workers answering now
    total: int  # workers the deployment has


class PoolBody(TypedDict):
    live: int
    total: int


class HealthBody(TypedDict):
    """GET /health's body."""

    status: str  # ok, degraded or unavailable
    pools: dict[str, PoolBody]


@dataclass(frozen=True)
class Health:
    """What /health reports: each pool's live workers, and whether a request can be served."""

    pools: dict[str, PoolState]
    serving: bool

    @property
    def status(self) -> str:
        if not self.serving:
            return "unavailable"
        return "degraded" if any(p.live < p.total for p in self.pools.values()) else "ok"

    def body(self) -> HealthBody:
        return {"status": self.status,
                "pools": {name: {"live": p.live, "total": p.total} for name, p in self.pools.items()}}


@dataclass(frozen=True)
class Reliability:
    """What the gateway exports about failures and recovery, read at scrape time
    (counters are the backend's own totals; 0 where a backend has no such thing)."""

    health: Health
    migrations: int = 0  # tries started because the previous try's worker died or its stream broke
    resumed_tokens: int = 0  # output tokens those tries did not send again
    exhausted: int = 0  # requests that failed after their last allowed try
    faulted: int = 0  # requests a worker's engine failed alone (never moved: the poison-pill rule)
    stream_gaps: int = 0  # batches missing from a worker's token-stream sequence
    stream_stale: int = 0  # deltas of a try given up on (a migrated request's old worker)
    stream_diverged: int = 0  # tries broken by a repeat of handed-on tokens that differed from them
    stream_forged: int = 0  # token-stream messages whose MAC did not check (dropped unread)
    stream_replayed: int = 0  # signed token-stream batches sent again (a number their publisher had used)
    workers_lost: int = 0  # workers that went from answering to not
    workers_readmitted: int = 0  # lost workers that answered again
    workers_restarted: int = 0  # workers that answered from a new process
    workers_stalled: int = 0  # workers given up on by the stall watch (held work, made no progress)
    role_switches_to_prefill: int = 0  # workers moved from the decode pool to the prefill pool
    role_switches_to_decode: int = 0  # ... from the prefill pool to the decode pool
    role_switch_failures: int = 0  # switches that failed (the worker kept or went back to its role)


class GenerationBackend(Protocol):
    """What the gateway needs from the cluster (or from one in-process engine)."""

    @property
    def healthy(self) -> bool:
        """Whether it can take a request now (else the gateway answers 503)."""
        ...

    def health(self) -> Health:
        """Its pools' live workers (degraded: some are down, requests still served)."""
        ...

    @property
    def num_in_flight(self) -> int: ...

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                 timeout_s: float) -> AsyncGenerator[RequestOutput, None]:
        """DELTA outputs until the final one. ValueError for bad input;
        NoHealthyWorkerError when no worker can take it; TimeoutError at the
        deadline. Leaving early (cancellation) aborts the request on its workers."""
        ...

    def worker_handles(self) -> WorkerHandles:
        """Actor name -> (pool, handle) of every worker whose metrics the gateway merges."""
        ...

    def router_stats(self) -> RouterStats | None:
        """The router's counters, where it routes (the gateway exports them)."""
        ...

    def reliability(self) -> Reliability:
        """Its health and failure counters now (the gateway exports them)."""
        ...

    async def start(self) -> None:
        """Before the first request, on the event loop that will serve (idempotent)."""
        ...

    def stop_all(self) -> None:
        """End every request in flight with ServerStoppingError now, and any that comes later
        (the server is stopping): each caller's stream raises it after what it has, and its
        request is aborted on its workers, so a stop's last moments end every stream with
        an error event rather than a cut connection."""
        ...

    async def close(self) -> None:
        """Stop what `start` started; requests in flight end."""
        ...


class Placement(Protocol):
    """Where one try of a request runs: the call that runs it there, and how to stop it."""

    async def call(self, req: ServeRequest) -> None:
        """Run `req` there; return when it is over (its final delta is sent), raise its error."""
        ...

    def abort(self, request_id: str) -> None:
        """Tell its workers to drop this try of the request (fire and forget; a later
        try of it on the same worker is left alone)."""
        ...


# (the request, the placement whose worker just died or None for the first try) -> where to run it.
# Raises NoHealthyWorkerError when nowhere is left.
Place = Callable[[ServeRequest, Placement | None], Placement]

# Failures of the worker, not of the request: the request moves to another worker.
# (Ray raises an actor's death as RayActorError; a worker whose engine thread died
# answers EngineDeadError, which Ray re-raises as a subclass of it.)
WORKER_LOST: tuple[type[BaseException], ...] = (RayActorError, EngineDeadError)
# ...and failures of the token stream between a worker and this gateway (a lost
# batch, a final delta that never came, a worker that could not send): the tokens
# handed on so far are sound, so the request goes on from them too. So does a
# request that a worker changing role refused or cut at the end of its drain
# (WorkerDrainingError: no failure, so it does not count against `max_migrations`).
RETRYABLE: tuple[type[BaseException], ...] = (*WORKER_LOST, StreamLostError, WorkerDrainingError)
# Moves after role switches a request may make beyond its `max_migrations` (a bound
# all the same: a worker that kept refusing must not keep a request going round).
_MAX_DRAIN_MOVES = 8


class ServerStoppingError(RuntimeError):
    """The server stopped before the request finished (`GenerationBackend.stop_all`)."""

    def __init__(self) -> None:
        super().__init__("the server stopped before the request finished")


class WorkerLostError(RuntimeError):
    """The request's workers kept dying: its retries are spent (the client gets this, not Ray's message)."""


@dataclass
class MigrationStats:
    """What the gateway exports about requests that moved after a worker died."""

    migrations: int = 0  # tries started because the previous try's worker died
    resumed_tokens: int = 0  # output tokens those tries did not have to send again
    exhausted: int = 0  # requests that failed after their last allowed try
    faulted: int = 0  # requests a worker's engine failed alone: not moved (the poison-pill rule)


# How long a request that has a place to go waits for a worker while none can take
# it (a pool's only worker restarting: Ray brings it back in seconds).
DEFAULT_WORKER_WAIT_S = 10.0
_WAIT_POLL_S = 0.1


class TokenStreams:
    """The gateway's token-stream collector (cluster/token_collector.py), made on
    first use in the event loop that serves requests, and the loop that runs a
    request's tries (`run` owns a request from its placing to its last delta; the
    collector's `watch` says how each try ended, and its deadline is the request's
    one deadline): when a try's worker dies, the next try starts on another
    worker from what the client already has (`Resume`), at most `max_migrations`
    times. A try that finds no worker to take it waits up to `worker_wait_s` (and
    never past the request's deadline) for one to come back: the client of a
    stream under way would lose what it has, while a new request is turned away
    at once by the gateway's admission (503 with Retry-After) when the backend is
    not healthy."""

    def __init__(self, bind_host: str | None, max_migrations: int = 2,
                 worker_wait_s: float = DEFAULT_WORKER_WAIT_S, secret: ClusterSecret | None = None,
                 stream_interval: int = 1) -> None:
        # Where workers reach this gateway: the kv_host setting, resolved on this
        # node when the collector is made (cluster/placement.py).
        self.bind_host = bind_host
        self.max_migrations = max_migrations
        self.worker_wait_s = worker_wait_s
        self.stats = MigrationStats()
        self._secret = secret  # the cluster's: workers sign their tokens with it (None: auth.default_secret())
        self.stream_interval = stream_interval  # the collector's: tokens a chunk gathers (--stream-interval)
        self._collector: TokenStreamCollector | None = None
        self._stopped = False  # `stop_all` was called: every request from then on ends with ServerStoppingError

    @property
    def collector(self) -> TokenStreamCollector:
        if self._collector is None:
            self._collector = TokenStreamCollector(bind_host(self.bind_host), secret=self._secret,
                                                   stream_interval=self.stream_interval)
        return self._collector

    def reliability(self, health: Health) -> Reliability:
        """Its counters now, with `health`; the collector's are 0 until a request made it
        (reading them does not make one)."""
        s, c = self.stats, self._collector
        return Reliability(health, s.migrations, s.resumed_tokens, s.exhausted, s.faulted,
                           stream_gaps=c.num_gaps if c is not None else 0,
                           stream_stale=c.num_stale if c is not None else 0,
                           stream_diverged=c.num_diverged if c is not None else 0,
                           stream_forged=c.num_forged if c is not None else 0,
                           stream_replayed=c.num_replayed if c is not None else 0)

    def stop_all(self) -> None:
        """`GenerationBackend.stop_all`: the open streams end with ServerStoppingError, and so
        does every request placed (or waiting for a worker) from now on."""
        self._stopped = True
        if self._collector is not None:
            n = self._collector.fail_all(ServerStoppingError)
            log.warning("stopping: %d request(s) still in flight ended with an error", n)

    def request(self, request_id: str, prompt: list[int], params: SamplingParams, timeout_s: float) -> ServeRequest:
        """What a worker is asked to run, with this gateway's stream as its `reply_to`."""
        return ServeRequest(request_id, tuple(prompt), params, timeout_s, self.collector.address)

    async def run(self, req: ServeRequest, place: Place) -> AsyncGenerator[RequestOutput, None]:
        """Place `req` and yield its deltas from the stream until the final one. Any
        end but its finish aborts it where it runs then."""
        placement = await self._place(req, place, None, time.monotonic() + req.timeout_s)
        where = [placement]  # NoHealthyWorkerError before anything starts: above
        life = self.collector.open(req.request_id, list(req.prompt_token_ids), req.timeout_s)
        life.on_exit(lambda exit: None if exit is Exit.FINISHED else where[-1].abort(req.request_id))
        async with contextlib.aclosing(self.collector.consume(req.request_id, self._tries(req, place, where))) as outs:
            async for out in outs:
                yield out

    async def _tries(self, req: ServeRequest, place: Place, where: list[Placement]) -> None:
        failures = 0  # tries that ended in a failure (not a worker changing role)
        while True:
            try:
                return await self.collector.watch(req.request_id, where[-1].call(req))
            except RequestFaultError:
                # Its own values or logits broke its row: another worker would fail it (or,
                # had the fault ended that worker's engine, die of it) too. Never moved.
                self.stats.faulted += 1
                raise
            except RETRYABLE as e:
                drained = isinstance(e, WorkerDrainingError)
                failures += not drained
                if failures > self.max_migrations or req.attempt >= self.max_migrations + _MAX_DRAIN_MOVES:
                    self.stats.exhausted += 1
                    raise WorkerLostError(f"request {req.request_id}: its worker failed {failures} times "
                                          f"({req.attempt + 1} tries); giving up") from e
                if drained:
                    log.info("request %s: its worker is changing role; moving it", req.request_id)
                else:
                    log.warning("request %s: its worker failed (%s); moving it", req.request_id, type(e).__name__)
                where[-1].abort(req.request_id)  # what survives of the try (a handoff's prefill worker) drops it
                retry = self.collector.next_attempt(req.request_id)
                req = dataclasses.replace(req, attempt=retry.attempt, resume=retry.resume,
                                          timeout_s=max(retry.remaining_s, 1e-3))
                where.append(await self._place(req, place, where[-1], time.monotonic() + req.timeout_s))
                self.stats.migrations += 1  # counted once it has somewhere to go
                self.stats.resumed_tokens += req.offset

    async def _place(self, req: ServeRequest, place: Place, failed: Placement | None, deadline: float) -> Placement:
        """`place(req, failed)`, waiting while no worker can take it, up to `worker_wait_s`
        or `deadline`; then NoHealthyWorkerError."""
        give_up = min(time.monotonic() + self.worker_wait_s, deadline)
        while True:
            if self._stopped:
                raise ServerStoppingError
            try:
                return place(req, failed)
            except NoHealthyWorkerError:
                if time.monotonic() + _WAIT_POLL_S > give_up:
                    raise
            if failed is not None:
                log.warning("request %s: no worker can take it; waiting up to %.1f s for one",
                            req.request_id, give_up - time.monotonic())
            failed = None  # reported once: a worker back meanwhile must not be marked failed again
            await asyncio.sleep(_WAIT_POLL_S)

    async def close(self) -> None:
        if self._collector is not None:
            await self._collector.close()
            self._collector = None


class ColocatedBackend:
    """Each worker runs prefill and decode. Requests go to the worker with the
    fewest in flight from this gateway (the baseline the disaggregated mode beats).
    A worker whose call failed is skipped for `retry_dead_s`, then tried again (Ray
    restarts it); its requests move to the others. A worker handle that is None
    (not found when the gateway started) is asked of `lookup(name)` every
    `retry_dead_s` until it is found. With a `stall_timeout_s` (0: none), the
    workers are polled (cluster/colocated_watch.py): one that holds work and makes
    no progress that long is given up and `restart`ed, one whose poll fails as a
    dead actor's call does is out of routing until it answers again."""

    def __init__(self, workers: list[WorkerHandle | None], stream_host: str | None = "127.0.0.1",
                 names: list[str] | None = None, max_migrations: int = 2, retry_dead_s: float = 5.0,
                 lookup: Callable[[str], WorkerHandle | None] | None = None,
                 worker_wait_s: float = DEFAULT_WORKER_WAIT_S, cluster_secret: ClusterSecret | None = None,
                 stream_interval: int = 1, stall_timeout_s: float = 0.0, restart: Restart = restart_actor,
                 poll_s: float | None = None, replica: tuple[int, int] = (0, 1)) -> None:
        if not workers:
            raise ValueError("workers: at least one worker is needed")
        rank, replicas = replica
        if not 0 <= rank < replicas:
            raise ValueError(f"replica: rank {rank} of {replicas} replicas")
        if names is not None and len(names) != len(workers):
            raise ValueError(f"names: {len(names)} names for {len(workers)} workers")
        self.workers = workers
        self.names = names or [f"worker-{i}" for i in range(len(workers))]
        self.streams = TokenStreams(stream_host, max_migrations, worker_wait_s, cluster_secret, stream_interval)
        self.retry_dead_s = retry_dead_s
        self.lookup = lookup
        self._secret = cluster_secret
        # Each worker's inbox channel (cluster/worker_channel.py), made on its first request;
        # dropped with the handle it was made for.
        self._channels: list[tuple[WorkerHandle, WorkerChannel] | None] = [None] * len(workers)
        self._in_flight = [0] * len(workers)
        # Where this replica's ties between workers begin (`replica`: its rank of how many).
        # A replica counts only its own requests in flight, so ties are the rule at low load:
        # broken from worker 0 by every replica, each replica's requests went to the same
        # first workers, and with N replicas most workers sat idle at low concurrency.
        self._first = rank * len(workers) // replicas
        self._dead: dict[int, float] = {}  # worker -> when a call to it failed
        self._down: set[int] = set()  # out of routing until a poll answers (the watch's)
        self._finder: asyncio.Task[None] | None = None
        self._index = {name: i for i, name in enumerate(self.names)}
        self.watch = ColocatedWatch(self, stall_timeout_s, restart, poll_s) if stall_timeout_s else None

    @property
    def healthy(self) -> bool:
        return bool(self._live())

    def health(self) -> Health:
        live = len(self._live())
        return Health({"colocated": PoolState(live, len(self.workers))}, serving=live > 0)

    @property
    def num_in_flight(self) -> int:
        return sum(self._in_flight)

    def worker_handles(self) -> WorkerHandles:
        return {name: ("colocated", w) for name, w in zip(self.names, self.workers)}

    def router_stats(self) -> RouterStats | None:
        return None

    def reliability(self) -> Reliability:
        r = self.streams.reliability(self.health())
        if self.watch is None:
            return r
        e = self.watch.events
        return dataclasses.replace(r, workers_lost=e.lost, workers_readmitted=e.readmitted,
                                   workers_restarted=e.restarted, workers_stalled=e.stalled)

    # -- what the watch asks (cluster/colocated_watch.py WatchedPool) ----------------------

    def handles(self) -> dict[str, WorkerHandle | None]:
        return dict(zip(self.names, self.workers))

    def tries(self) -> dict[str, int]:
        return {name: n for name, n in zip(self.names, self._in_flight) if n}

    def down(self, name: str) -> None:
        self._down.add(self._index[name])

    def up(self, name: str) -> None:
        self._down.discard(self._index[name])

    def fail_tries(self, name: str, error: Callable[[], BaseException]) -> None:
        held = self._channels[self._index[name]]
        if held is not None:
            held[1].fail_tries(error)

    async def start(self) -> None:
        if self._finder is None and self.lookup is not None and None in self.workers:
            self._finder = asyncio.create_task(self._find_missing())
        if self.watch is not None:
            self.watch.start()

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncGenerator[RequestOutput, None]:
        await self.start()
        req = self.streams.request(request_id, prompt, params, timeout_s)
        async with contextlib.aclosing(self.streams.run(req, self._place)) as outs:
            async for out in outs:
                yield out

    async def _find_missing(self) -> None:
        assert self.lookup is not None
        while None in self.workers:
            for i, name in enumerate(self.names):
                if self.workers[i] is None:
                    self.workers[i] = await asyncio.to_thread(self.lookup, name)
            await asyncio.sleep(self.retry_dead_s)

    def _live(self) -> list[int]:
        now = time.monotonic()
        return [i for i, w in enumerate(self.workers)
                if w is not None and i not in self._down and now - self._dead.get(i, -math.inf) >= self.retry_dead_s]

    def _place(self, req: ServeRequest, failed: Placement | None) -> Placement:
        if isinstance(failed, _OnWorker) and failed.lost:
            if failed.index not in self._dead:
                log.warning("worker %s lost (a try on it failed so): out of routing for %.0f s",
                            self.names[failed.index], self.retry_dead_s)
            self._dead[failed.index] = time.monotonic()
            if self.watch is not None:
                self.watch.lost(self.names[failed.index])
        live = self._live()
        if not live:
            raise NoHealthyWorkerError("colocated")  # the gateway answers 503
        if isinstance(failed, _OnWorker):  # alive, but the try failed there: elsewhere if there is one
            live = [j for j in live if j != failed.index] or live
        # Its try number from the start: an abort before `call` runs must name this try.
        n = len(self.workers)
        return _OnWorker(self, min(live, key=lambda j: (self._in_flight[j], (j - self._first) % n)),
                         attempt=req.attempt)

    async def serve_on(self, index: int, req: ServeRequest) -> None:
        """Run `req` on worker `index` (one `_place` chose: found and live), counted in
        flight there while it runs; a worker that answers is alive (again)."""
        self._in_flight[index] += 1
        try:
            await self._channel(index).run(req, self.streams.collector.finished(req.request_id))
            self._dead.pop(index, None)
        finally:
            self._in_flight[index] -= 1

    def _channel(self, index: int) -> WorkerChannel:
        handle = self.workers[index]
        assert handle is not None  # only found ones are placed
        held = self._channels[index]
        if held is None or held[0] is not handle or held[1].gateway != self.streams.collector.address:
            if held is not None:
                held[1].discard()  # a restarted worker's new handle: the old one's tries failed with it
            held = self._channels[index] = (handle, WorkerChannel(handle, self.streams.collector.address,
                                                                  self._secret))
        return held[1]

    def abort_on(self, index: int, request_id: str, attempt: int) -> None:
        """Tell worker `index` to drop try `attempt` of a request (fire and forget): on its
        inbox, after the start; by a Ray call where the channel is down."""
        held = self._channels[index]
        if held is None or not held[1].abort(request_id, attempt):
            abort_try(self.workers[index], request_id, attempt)

    def stop_all(self) -> None:
        self.streams.stop_all()

    async def close(self) -> None:
        if self._finder is not None:
            self._finder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._finder
        if self.watch is not None:
            await self.watch.close()
        for held in self._channels:
            if held is not None:
                await held[1].close()
        self._channels = [None] * len(self.workers)
        await self.streams.close()


@dataclass(eq=False)
class _OnWorker:
    """A try of a request on one colocated worker."""

    backend: ColocatedBackend
    index: int
    lost: bool = False  # the worker died (not just this try's stream)
    attempt: int = 0

    async def call(self, req: ServeRequest) -> None:
        self.attempt = req.attempt
        try:
            await self.backend.serve_on(self.index, req)
        except WORKER_LOST:
            self.lost = True
            raise

    def abort(self, request_id: str) -> None:
        self.backend.abort_on(self.index, request_id, self.attempt)


class LocalBackend:
    """One in-process engine, no Ray and no token stream (tests, benchmarks, a
    single-process server): the engine hands its outputs to the caller directly."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._stopped = False
        self._ending: asyncio.Future[int] | None = None  # `stop_all`'s, held so it is not collected mid-run

    @property
    def healthy(self) -> bool:
        return self.engine.healthy

    def health(self) -> Health:
        live = int(self.engine.healthy)
        return Health({"engine": PoolState(live, 1)}, serving=live > 0)

    @property
    def num_in_flight(self) -> int:
        return self.engine.num_in_flight

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                 timeout_s: float) -> AsyncGenerator[RequestOutput, None]:
        if self._stopped:
            raise ServerStoppingError
        self.engine.start()  # on the first request, like the cluster's backends
        return self.engine.generate(request_id, prompt, params, timeout_s)

    def worker_handles(self) -> WorkerHandles:
        return {}

    def router_stats(self) -> RouterStats | None:
        return None

    def reliability(self) -> Reliability:
        return Reliability(self.health())  # no token stream, no workers to lose

    async def start(self) -> None:
        self.engine.start()

    def stop_all(self) -> None:
        """Its engine's requests end with ServerStoppingError, and so does every later one."""
        self._stopped = True
        self._ending = asyncio.ensure_future(self.engine.end_all(ServerStoppingError()))

    async def close(self) -> None:
        self.engine.close()

