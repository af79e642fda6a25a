"""The gateway's view of the worker pools: pick a worker, stream from it, abort on exit."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import RayActorError

from pdserve.cluster.router.policy import NoHealthyWorkerError
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.token_stream import TokenStreamCollector


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """Plain fields only: the worker rebuilds (and re-validates) SamplingParams."""
    fields = dataclasses.asdict(params)
    fields.pop("output_kind", None)
    return fields


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

    def worker_handles(self) -> dict[str, tuple[str, Any]]:
        """Actor name -> (pool, handle) of every worker, for the gateway's metrics scrape."""
        return {name: ("colocated", w) for name, w in zip(self.names, self.workers)}

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, timeout_s: float) -> AsyncIterator[RequestOutput]:
        live = [i for i in range(len(self.workers)) if i not in self._dead]
        if not live:
            raise NoHealthyWorkerError("colocated")  # the gateway answers 503
        i = min(live, key=lambda j: (self._in_flight[j], j))
        worker = self.workers[i]
        self._in_flight[i] += 1
        finished = False
        collector = self.streams.collector
        collector.open(request_id, prompt)
        try:
            start = worker.generate_to.remote(request_id, prompt, params_to_wire(params), timeout_s, collector.address)
            async for out in collector.consume(request_id, start, time.monotonic() + timeout_s):
                yield out
                finished = out.finished
        except RayActorError:
            self._dead.add(i)
            raise
        finally:
            collector.discard(request_id)
            self._in_flight[i] -= 1
            if not finished and i not in self._dead:
                worker.abort.remote(request_id)  # fire and forget: the worker frees the blocks


    async def close(self) -> None:
        await self.streams.close()


def get_workers(names: list[str], namespace: str) -> list[Any]:
    return [ray.get_actor(name, namespace=namespace) for name in names]
