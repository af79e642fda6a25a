"""The colocated backends: a pool of whole workers (`ColocatedBackend`), and one engine in
this process (`LocalBackend`). What a backend is: cluster/backend_api.py.

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

from pdserve.cluster.backend_api import Health, Placement, PoolState, Reliability, ServerStoppingError
from pdserve.cluster.colocated_watch import ColocatedWatch
from pdserve.cluster.metrics import WorkerHandles
from pdserve.cluster.router.policy import NoHealthyWorkerError
from pdserve.cluster.router.router import RouterStats
from pdserve.cluster.token_streams import DEFAULT_WORKER_WAIT_S, WORKER_LOST, TokenStreams
from pdserve.cluster.worker_channel import WorkerChannel
from pdserve.cluster.worker_events import Restart, restart_actor
from pdserve.cluster.worker_handle import WorkerHandle, abort_try
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.handoff import ServeRequest
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.transfer.auth import ClusterSecret

log = logging.getLogger(__name__)


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

