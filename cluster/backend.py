"""The gateway's view of the worker pools: pick a worker, stream from it, abort on exit."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import RayActorError

from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import SamplingParams


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """Plain fields only: the worker rebuilds (and re-validates) SamplingParams."""
    fields = dataclasses.asdict(params)
    fields.pop("output_kind", None)
    return fields


class ColocatedBackend:
    """Each worker runs prefill and decode. Requests go to the worker with the
    fewest in flight from this gateway (the baseline the disaggregated mode beats)."""

    def __init__(self, workers: list[Any]) -> None:
        if not workers:
            raise ValueError("workers: at least one worker is needed")
        self.workers = workers
        self._in_flight = [0] * len(workers)
        self._dead: set[int] = set()

    @property
    def healthy(self) -> bool:
        return len(self._dead) < len(self.workers)

    @property
    def num_in_flight(self) -> int:
        return sum(self._in_flight)

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, timeout_s: float) -> AsyncIterator[RequestOutput]:
        live = [i for i in range(len(self.workers)) if i not in self._dead]
        if not live:
            raise RuntimeError("no healthy worker")
        i = min(live, key=lambda j: (self._in_flight[j], j))
        worker = self.workers[i]
        self._in_flight[i] += 1
        finished = False
        try:
            stream = worker.generate.options(num_returns="streaming").remote(request_id, prompt, params_to_wire(params), timeout_s)
            async for ref in stream:
                out: RequestOutput = await ref
                yield out
                finished = out.finished
        except RayActorError:
            self._dead.add(i)
            raise
        finally:
            self._in_flight[i] -= 1
            if not finished and i not in self._dead:
                worker.abort.remote(request_id)  # fire and forget: the worker frees the blocks


def get_workers(names: list[str], namespace: str) -> list[Any]:
    return [ray.get_actor(name, namespace=namespace) for name in names]
