"""Thin Ray actors around the plain worker classes. Nothing here decides anything."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import ray

from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine import LLMEngine
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import SamplingParams


@ray.remote
class EngineWorkerActor:
    """One engine (a colocated worker: prefill and decode). Async actor: many
    requests stream through it at once while its engine thread batches them."""

    def __init__(self, config: dict[str, Any], torch_threads: int) -> None:
        import torch

        # Workers share the node's cores: more threads than cores makes OpenMP
        # threads spin against each other (measured: 50x slower decode steps).
        torch.set_num_threads(torch_threads)
        self.engine = AsyncEngine(LLMEngine(EngineConfig(**config)))

    async def ready(self) -> dict[str, Any]:
        e = self.engine.engine
        return {"num_kv_blocks": e.num_kv_blocks, "max_model_len": e.max_model_len}

    async def generate(self, request_id: str, prompt: list[int], params: dict[str, Any], timeout_s: float) -> AsyncIterator[RequestOutput]:
        async for out in self.engine.generate(request_id, prompt, SamplingParams(**params), timeout_s):
            yield out

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def load(self) -> dict[str, Any]:
        """Counters the router and the leak tests read (from the engine thread)."""

        def read(e: LLMEngine) -> dict[str, Any]:
            return {"healthy": True, "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                    "used_blocks": e.kv.pool.num_used, "free_blocks": e.kv.pool.num_free,
                    "cached_blocks": len(e.kv.pool.cached), "prompt_tokens_computed": e.stats.prompt_tokens_computed}

        return await self.engine.call(read)  # type: ignore[return-value]
