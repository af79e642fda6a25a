"""The gateway's view of its workers: a `GenerationBackend` runs a request and
yields its DELTA outputs.

Every backend runs a request the same way: one call starts it on a worker
(`ServeRequest`, with this gateway's token stream as `reply_to`), and every
token, the first included, comes back on that stream (`TokenStreams.run`).
The request's gateway-side lifecycle ends with the stream; any end but its
finish aborts it on its workers, which frees its blocks there.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import ray
from ray.exceptions import RayActorError

from pdserve.cluster.metrics import WorkerHandles
from pdserve.cluster.router.policy import NoHealthyWorkerError
from pdserve.cluster.router.router import RouterStats
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.handoff import ServeRequest
from pdserve.workers.lifecycle import Exit
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.token_stream import TokenStreamCollector


class GenerationBackend(Protocol):
    """What the gateway needs from the cluster (or from one in-process engine)."""

    @property
    def healthy(self) -> bool:
        """Whether it can take a request now (else the gateway answers 503)."""
        ...

    @property
    def num_in_flight(self) -> int: ...

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                 timeout_s: float) -> AsyncIterator[RequestOutput]:
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

    async def start(self) -> None:
        """Before the first request, on the event loop that will serve (idempotent)."""
        ...

    async def close(self) -> None:
        """Stop what `start` started; requests in flight end."""
        ...


class TokenStreams:
    """The gateway's token-stream collector (workers/token_stream.py), made on
    first use in the event loop that serves requests."""

    def __init__(self, bind_host: str) -> None:
        # Where workers reach this gateway: loopback on one machine, the node's
        # address ("auto") when workers run on other nodes.
        self.bind_host = bind_host
        self._collector: TokenStreamCollector | None = None

    @property
    def collector(self) -> TokenStreamCollector:
        if self._collector is None:
            host = ray.util.get_node_ip_address() if self.bind_host == "auto" else self.bind_host
            self._collector = TokenStreamCollector(host)
        return self._collector

    def request(self, request_id: str, prompt: list[int], params: SamplingParams, timeout_s: float) -> ServeRequest:
        """What a worker is asked to run, with this gateway's stream as its `reply_to`."""
        return ServeRequest(request_id, tuple(prompt), params, timeout_s, self.collector.address)

    async def run(self, req: ServeRequest, start: Callable[[], Awaitable[Any]],
                  abort: Callable[[], None]) -> AsyncIterator[RequestOutput]:
        """`start()` runs the request (a worker call that returns when it is over);
        yield its deltas from the stream. `abort()` runs on any end but its finish."""
        life = self.collector.open(req.request_id, list(req.prompt_token_ids), req.timeout_s)
        life.on_exit(lambda exit: None if exit is Exit.FINISHED else abort())

        async def call() -> Any:  # a call that fails at once fails the stream, like one that fails later
            return await start()

        async for out in self.collector.consume(req.request_id, call()):
            yield out

    async def close(self) -> None:
        if self._collector is not None:
            await self._collector.close()
            self._collector = None


class ColocatedBackend:
    """Each worker runs prefill and decode. Requests go to the worker with the
    fewest in flight from this gateway (the baseline the disaggregated mode beats)."""

    def __init__(self, workers: list[Any], stream_host: str = "127.0.0.1", names: list[str] | None = None) -> None:
        if not workers:
            raise ValueError("workers: at least one worker is needed")
        if names is not None and len(names) != len(workers):
            raise ValueError(f"names: {len(names)} names for {len(workers)} workers")
        self.workers = workers
        self.names = names or [f"worker-{i}" for i in range(len(workers))]
        self.streams = TokenStreams(stream_host)
        self._in_flight = [0] * len(workers)
        self._dead: set[int] = set()

    @property
    def healthy(self) -> bool:
        return len(self._dead) < len(self.workers)

    @property
    def num_in_flight(self) -> int:
        return sum(self._in_flight)

    def worker_handles(self) -> WorkerHandles:
        return {name: ("colocated", w) for name, w in zip(self.names, self.workers)}

    def router_stats(self) -> RouterStats | None:
        return None

    async def start(self) -> None:
        pass

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        live = [i for i in range(len(self.workers)) if i not in self._dead]
        if not live:
            raise NoHealthyWorkerError("colocated")  # the gateway answers 503
        i = min(live, key=lambda j: (self._in_flight[j], j))
        worker = self.workers[i]
        req = self.streams.request(request_id, prompt, params, timeout_s)
        self._in_flight[i] += 1
        try:
            async for out in self.streams.run(req, lambda: worker.serve.remote(req),
                                              lambda: _abort(worker, request_id)):
                yield out
        except RayActorError:
            self._dead.add(i)
            raise
        finally:
            self._in_flight[i] -= 1

    async def close(self) -> None:
        await self.streams.close()


class LocalBackend:
    """One in-process engine, no Ray and no token stream (tests, benchmarks, a
    single-process server): the engine hands its outputs to the caller directly."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    @property
    def healthy(self) -> bool:
        return self.engine.healthy

    @property
    def num_in_flight(self) -> int:
        return self.engine.num_in_flight

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                 timeout_s: float) -> AsyncIterator[RequestOutput]:
        self.engine.start()  # on the first request, like the cluster's backends
        return self.engine.generate(request_id, prompt, params, timeout_s)

    def worker_handles(self) -> WorkerHandles:
        return {}

    def router_stats(self) -> RouterStats | None:
        return None

    async def start(self) -> None:
        self.engine.start()

    async def close(self) -> None:
        self.engine.close()


def _abort(worker: Any, request_id: str) -> None:
    """Tell a worker to drop a request; fire and forget (a dead one is already rid of it)."""
    with contextlib.suppress(RayActorError):
        worker.abort.remote(request_id)
