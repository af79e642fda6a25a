"""A request's tries, from its placing to its last delta (`TokenStreams.run`): every token comes
back on this gateway's token stream (cluster/token_collector.py); when a try's worker dies or
its stream breaks, the next try starts on another worker from what the client already has."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from pdserve.cluster.backend_api import Health, Place, Placement, Reliability, ServerStoppingError, WorkerLostError
from pdserve.cluster.placement import bind_host
from pdserve.cluster.ray_errors import RayActorError
from pdserve.cluster.router.policy import NoHealthyWorkerError
from pdserve.cluster.token_collector import TokenStreamCollector
from pdserve.workers.async_engine import EngineDeadError, RequestFaultError, WorkerDrainingError
from pdserve.workers.handoff import ServeRequest
from pdserve.workers.lifecycle import Exit
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.token_stream import StreamLostError
from pdserve.workers.transfer.auth import ClusterSecret

log = logging.getLogger(__name__)

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
