"""What the gateway asks of the cluster: a `GenerationBackend` (runs a request, yields its DELTA
outputs, reports health and counters), a `Placement` (where one try of a request runs), and
the errors a request ends with when its workers cannot finish it. The backends:
cluster/backend.py (colocated, in-process), cluster/disagg_backend.py (prefill and decode)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol, TypedDict

from pdserve.cluster.metrics import WorkerHandles
from pdserve.cluster.router.router import RouterStats
from pdserve.workers.handoff import ServeRequest
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import SamplingParams


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

class ServerStoppingError(RuntimeError):
    """The server stopped before the request finished (`GenerationBackend.stop_all`)."""

    def __init__(self) -> None:
        super().__init__("the server stopped before the request finished")


class WorkerLostError(RuntimeError):
    """The request's workers kept dying: its retries are spent (the client gets this, not Ray's message)."""
