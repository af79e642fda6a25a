"""The worker services the cluster runs as Ray actors, and the actors themselves.

Each service is a plain class over a Ray-free worker (tests drive them in one
process); `ray.remote` at the bottom makes the actors. Nothing here decides
anything: routing is the router's, scheduling the engine's.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import ray

from pdserve.cluster.worker_metrics import Pool, WorkerMetrics
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine import LLMEngine
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import SamplingParams


class EngineService:
    """One engine (a colocated worker: prefill and decode). Async actor: many
    requests stream through it at once while its engine thread batches them."""

    def __init__(self, config: dict[str, Any], torch_threads: int, worker_name: str | None = None) -> None:
        engine = _engine(config, torch_threads, record_events=False)
        self.worker_metrics = _worker_metrics(Pool.COLOCATED, worker_name, engine)
        self.engine = AsyncEngine(engine, worker_id=f"worker-{os.getpid()}")

    async def ready(self) -> dict[str, Any]:
        e = self.engine.engine
        return {"num_kv_blocks": e.num_kv_blocks, "max_model_len": e.max_model_len}

    async def generate(self, request_id: str, prompt: list[int], params: dict[str, Any], timeout_s: float) -> AsyncIterator[RequestOutput]:
        async for out in self.engine.generate(request_id, prompt, SamplingParams(**params), timeout_s):
            yield out

    async def generate_to(self, request_id: str, prompt: list[int], params: dict[str, Any], timeout_s: float,
                          reply_to: str) -> None:
        """`generate`, with the deltas sent to the gateway's token stream at
        `reply_to`; returns when the request is over, raises its error."""
        async for _ in self.engine.generate(request_id, prompt, SamplingParams(**params), timeout_s, reply_to):
            pass

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def load(self) -> dict[str, Any]:
        """Counters the router and the leak tests read (from the engine thread)."""
        return await self.engine.call(_load)  # type: ignore[return-value]

    async def metrics(self) -> bytes:
        """This worker's Prometheus exposition (the gateway merges every worker's)."""
        return await _render_metrics(self.engine, self.worker_metrics)


def _engine(config: dict[str, Any], torch_threads: int, record_events: bool = True) -> LLMEngine:
    import torch

    # Workers share the node's cores: more threads than cores makes OpenMP
    # threads spin against each other (measured: 50x slower decode steps).
    torch.set_num_threads(torch_threads)
    return LLMEngine(EngineConfig(**{**config, "record_kv_events": record_events}))


def _worker_metrics(pool: Pool, worker_name: str | None, engine: LLMEngine) -> WorkerMetrics:
    """The worker's registry, observing `engine`'s steps (before its thread starts).
    The name is the actor's (serve_app passes it): the `worker` label."""
    metrics = WorkerMetrics(pool, worker_name or f"{pool.value}-{os.getpid()}", engine.config.num_speculative_tokens)
    metrics.attach(engine)
    return metrics


# A scrape waits this long for the engine thread to sample its counters; past
# it (a long step), the last sample goes out with the current step histograms.
_SAMPLE_TIMEOUT_S = 1.0


async def _render_metrics(engine: AsyncEngine, metrics: WorkerMetrics) -> bytes:
    try:
        await engine.call(metrics.sample, timeout_s=_SAMPLE_TIMEOUT_S)
    except TimeoutError:
        pass
    return metrics.render()


def _transport_classes(transport: str) -> tuple[Any, Any]:
    """(sender, receiver) classes: ZeroMQ for any two hosts; NCCL between GPUs
    (gloo, the same code path, when the caches are on the CPU)."""
    if transport == "zmq":
        from pdserve.workers.transfer.zmq_backend import ZmqKVReceiver, ZmqKVSender

        return ZmqKVSender, ZmqKVReceiver
    if transport == "nccl":
        from pdserve.workers.transfer.nccl_backend import NcclKVReceiver, NcclKVSender

        return NcclKVSender, NcclKVReceiver
    raise ValueError(f"transport: must be zmq or nccl, got {transport!r}")


def _load(e: LLMEngine) -> dict[str, Any]:
    """Engine thread: what the router needs, plus the KV events since the last call."""
    s = e.snapshot()
    events = [(ev.kind.value, ev.block_hash, ev.parent_hash) for ev in e.take_kv_events()]
    return {"queued_prefill_tokens": s.queued_prefill_tokens, "running": s.running, "waiting": s.waiting,
            "free_blocks": s.free_blocks, "total_blocks": s.total_blocks, "used_blocks": s.used_blocks,
            "prompt_tokens_computed": s.prompt_tokens_computed, "generation_tokens": s.generation_tokens,
            "events": events, "spec_drafts": s.spec_drafts, "spec_draft_tokens": s.spec_draft_tokens,
            "spec_accepted_tokens": s.spec_accepted_tokens,
            "spec_accepted_per_position": list(s.spec_accepted_per_position)}


class PrefillService:
    """A prefill worker: computes prompts and streams their KV to decode workers over ZeroMQ."""

    def __init__(self, config: dict[str, Any], torch_threads: int, transport: str = "zmq",
                 worker_name: str | None = None) -> None:
        from pdserve.workers.prefill_worker import PrefillWorker
        from pdserve.workers.transfer.base import KVSender

        # A prefill worker never decodes, so it never drafts: no draft model to load.
        engine = _engine({**config, "speculative": None, "draft_model": None}, torch_threads)
        sender_cls = _transport_classes(transport)[0]
        self._senders: dict[str, KVSender] = {}

        def sender_for(address: str) -> KVSender:
            if address not in self._senders:
                self._senders[address] = sender_cls(engine.kv_caches, address)
            return self._senders[address]

        self.worker_metrics = _worker_metrics(Pool.PREFILL, worker_name, engine)
        self.worker = PrefillWorker(engine, sender_for, transfer_recorder=self.worker_metrics)

    async def ready(self) -> dict[str, Any]:
        e = self.worker.engine
        return {"num_kv_blocks": e.num_kv_blocks, "max_model_len": e.max_model_len}

    async def prefill(self, request_id: str, prompt: list[int], params: dict[str, Any], dst_blocks: list[int],
                      cached_on_decode: int, receiver: str, timeout_s: float) -> RequestOutput:
        return await self.worker.prefill(request_id, prompt, SamplingParams(**params), dst_blocks, cached_on_decode,
                                         receiver, timeout_s)

    async def generate_alone(self, request_id: str, prompt: list[int], params: dict[str, Any],
                             timeout_s: float) -> RequestOutput:
        return await self.worker.generate_alone(request_id, prompt, SamplingParams(**params), timeout_s)

    async def abort(self, request_id: str) -> None:
        await self.worker.async_engine.call(lambda e: e.abort(request_id))

    async def load(self) -> dict[str, Any]:
        return await self.worker.async_engine.call(_load)  # type: ignore[return-value]

    async def metrics(self) -> bytes:
        return await _render_metrics(self.worker.async_engine, self.worker_metrics)


class DecodeService:
    """A decode worker: reserves blocks, receives KV over ZeroMQ, decodes in a continuous batch.
    It can also serve a request end to end (local prefill) when the router says so."""

    def __init__(self, config: dict[str, Any], torch_threads: int, bind_host: str, transport: str = "zmq",
                 worker_name: str | None = None) -> None:
        from pdserve.workers.decode_worker import DecodeWorker

        engine = _engine(config, torch_threads)
        if bind_host == "auto":  # this node's address, reachable from prefill workers on other nodes
            bind_host = ray.util.get_node_ip_address()
        self.receiver = _transport_classes(transport)[1](engine.kv_caches, bind=f"tcp://{bind_host}:*")
        self.worker_metrics = _worker_metrics(Pool.DECODE, worker_name, engine)
        self.worker = DecodeWorker(engine, self.receiver, transfer_recorder=self.worker_metrics)

    async def ready(self) -> dict[str, Any]:
        e = self.worker.engine
        return {"num_kv_blocks": e.num_kv_blocks, "max_model_len": e.max_model_len, "address": self.receiver.address}

    async def reserve(self, request_id: str, prompt: list[int], params: dict[str, Any]) -> tuple[list[int], int] | None:
        return await self.worker.reserve(request_id, prompt, SamplingParams(**params))

    async def decode(self, request_id: str, prompt: list[int], first: RequestOutput | None, cached_here: int,
                     timeout_s: float, first_sent: bool = False) -> AsyncIterator[RequestOutput]:
        async for out in self.worker.decode(request_id, prompt, first, cached_here, timeout_s, first_sent):
            yield out

    async def generate(self, request_id: str, prompt: list[int], params: dict[str, Any], timeout_s: float) -> AsyncIterator[RequestOutput]:
        async for out in self.worker.async_engine.generate(request_id, prompt, SamplingParams(**params), timeout_s):
            yield out

    async def generate_to(self, request_id: str, prompt: list[int], params: dict[str, Any], timeout_s: float,
                          reply_to: str) -> None:
        """The whole request here (the router chose local prefill); deltas to `reply_to`."""
        async for _ in self.worker.async_engine.generate(request_id, prompt, SamplingParams(**params), timeout_s,
                                                         reply_to):
            pass

    async def decode_to(self, request_id: str, prompt: list[int], first: RequestOutput | None, cached_here: int,
                        timeout_s: float, first_sent: bool, reply_to: str) -> None:
        """`decode`, with the deltas sent to the gateway's token stream at `reply_to`."""
        async for _ in self.worker.decode(request_id, prompt, first, cached_here, timeout_s, first_sent, reply_to):
            pass

    async def abort(self, request_id: str) -> None:
        await self.worker.abort(request_id)

    async def load(self) -> dict[str, Any]:
        return await self.worker.async_engine.call(_load)  # type: ignore[return-value]

    async def metrics(self) -> bytes:
        return await _render_metrics(self.worker.async_engine, self.worker_metrics)


# The Ray actors: the plain services above, one process (and one GPU) each.
EngineWorkerActor = ray.remote(EngineService)
PrefillWorkerActor = ray.remote(PrefillService)
DecodeWorkerActor = ray.remote(DecodeService)
