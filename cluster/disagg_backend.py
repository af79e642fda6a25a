"""The gateway's coordinator for disaggregated serving.

One request: route (cache- and load-aware) -> the decode worker reserves blocks
-> the prefill worker prefills and streams KV into them -> the decode worker
streams tokens. Any exit before the end (client gone, deadline, worker error)
aborts the request on both workers, which frees its blocks on both sides.
Worker loads and KV events reach the router from a poller every `poll_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError

from pdserve.cluster.backend import TokenStreams, params_to_wire
from pdserve.cluster.router import Router
from pdserve.cluster.router.policy import WorkerLoad, WorkerRole
from pdserve.workers.kv.events import KVEvent, KVEventKind
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import SamplingParams


def _first_token_is_not_last(first: RequestOutput, params: SamplingParams) -> bool:
    """Whether the prefill worker's first token can go to the client as it is,
    before the decode worker continues: it did not stop the request (the prefill
    ran with max_tokens=1, so "length" means no EOS or stop token), and no stop
    string could cut its text."""
    c = first.outputs[0]
    return (c.finish_reason == "length" and len(c.token_ids) == 1 and not params.stop
            and (params.max_tokens is None or params.max_tokens > 1))


class DisaggregatedBackend:
    def __init__(self, prefill: dict[str, Any], decode: dict[str, Any], decode_addresses: dict[str, str],
                 router: Router, poll_s: float = 0.05, stream_host: str = "127.0.0.1",
                 names: dict[str, str] | None = None) -> None:
        """`prefill`/`decode`: router worker id -> actor handle; `names`: router
        worker id -> actor name (the `worker` label of its metrics; default the id)."""
        self.prefill, self.decode, self.addresses, self.router = prefill, decode, decode_addresses, router
        self.names = names or {}
        self.streams = TokenStreams(stream_host)
        self.poll_s = poll_s
        self._in_flight = 0
        self._dead: set[str] = set()
        self._poller: asyncio.Task[None] | None = None
        self._closing = False
        self._ready = asyncio.Event()
        self.loads: dict[str, dict[str, Any]] = {}

    @property
    def healthy(self) -> bool:
        return any(w not in self._dead for w in self.decode) and (
            any(w not in self._dead for w in self.prefill) or not self.prefill)

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def worker_handles(self) -> dict[str, tuple[str, Any]]:
        """Actor name -> (pool, handle) of every worker, for the gateway's metrics scrape."""
        pools = [("prefill", self.prefill), ("decode", self.decode)]
        return {self.names.get(wid, wid): (pool, h) for pool, handles in pools for wid, h in handles.items()}

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, timeout_s: float) -> AsyncIterator[RequestOutput]:
        if self._poller is None:
            self._closing = False
            self._ready = asyncio.Event()
            self._poller = asyncio.create_task(self._poll_loads())
        # The router knows no worker until the first poll has answered.
        await asyncio.wait_for(self._ready.wait(), timeout=30.0)
        decision = self.router.route(request_id, prompt)
        d_id, p_id = decision.decode_worker, decision.prefill_worker
        d = self.decode[d_id]
        wire = params_to_wire(params)
        self._in_flight += 1
        finished = False
        deadline = time.monotonic() + timeout_s
        collector = self.streams.collector
        collector.open(request_id, prompt)
        # The prefill worker's queue time, when it prefilled: the request's
        # first queue (the decode worker's own "queue time" spans the prefill).
        first_metrics: dict[str, float] | None = None
        try:
            if params.max_tokens == 1 and not decision.local_prefill and p_id is not None:
                # Ends at its first token: the prefill worker runs it alone (no decode
                # blocks reserved, no KV shipped). If it is gone, the decode worker does.
                try:
                    out = await self.prefill[p_id].generate_alone.remote(request_id, prompt, wire, timeout_s)
                except RayActorError:
                    self._dead.add(p_id)
                else:
                    finished = True
                    yield out
                    return
                start = d.generate_to.remote(request_id, prompt, wire, timeout_s, collector.address)
            elif decision.local_prefill or p_id is None:
                start = d.generate_to.remote(request_id, prompt, wire, timeout_s, collector.address)
            else:
                start, first, first_metrics = await self._handoff(request_id, prompt, params, wire, timeout_s, p_id,
                                                                  d_id, collector.address)
                if first is not None:
                    yield first
            async for out in collector.consume(request_id, start, deadline):
                if first_metrics is not None:
                    out.metrics = first_metrics
                yield out
                finished = out.finished
        finally:
            collector.discard(request_id)
            self._in_flight -= 1
            if not finished:
                for worker in [d] + ([self.prefill[p_id]] if p_id else []):
                    with contextlib.suppress(RayActorError):
                        worker.abort.remote(request_id)

    async def _handoff(self, request_id: str, prompt: list[int], params: SamplingParams, wire: dict[str, Any],
                       timeout_s: float, p_id: str, d_id: str,
                       reply_to: str) -> tuple[Any, RequestOutput | None, dict[str, float] | None]:
        """Reserve on D, prefill on P; returns D's call that streams the rest to
        `reply_to`, the first token's output when it goes to the client now,
        before D's stream starts, and P's output metrics (None if P did not prefill)."""
        d = self.decode[d_id]
        plan = await d.reserve.remote(request_id, prompt, wire)
        if plan is None:  # no room on the decode worker now: it queues and prefills the request itself
            return d.generate_to.remote(request_id, prompt, wire, timeout_s, reply_to), None, None
        blocks, cached_here = plan
        first: RequestOutput | None
        try:
            first = await self.prefill[p_id].prefill.remote(request_id, prompt, wire, blocks, cached_here,
                                                            self.addresses[d_id], timeout_s)
        except RayActorError:
            self._dead.add(p_id)
            first = None
        except Exception:  # noqa: BLE001 - RayTaskError around TransferError / timeout
            first = None  # the prefill or its transfer failed: the decode worker applies its policy
        early = first is not None and _first_token_is_not_last(first, params)
        stream = d.decode_to.remote(request_id, prompt, first, cached_here, timeout_s, early, reply_to)
        first_metrics = first.metrics if first is not None else None
        if not early:
            return stream, None, first_metrics
        assert first is not None
        c = first.outputs[0]
        return stream, RequestOutput(request_id, first.prompt, first.prompt_token_ids,
                                     [dataclasses.replace(c, finish_reason=None, stop_reason=None)], False,
                                     first.num_cached_tokens, first.metrics, first.prompt_logprobs), first_metrics

    async def close(self) -> None:
        await self.streams.close()
        self._closing = True  # Python 3.11's wait_for can swallow a cancel: the loop checks this too
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    async def _refresh(self) -> None:
        workers = {**{k: (v, WorkerRole.PREFILL) for k, v in self.prefill.items()},
                   **{k: (v, WorkerRole.DECODE) for k, v in self.decode.items()}}
        for wid, (actor, role) in workers.items():
            try:
                load = await asyncio.wait_for(actor.load.remote(), timeout=5.0)
            except (TimeoutError, RayActorError):
                self._dead.add(wid)
                self.router.update_load(WorkerLoad(wid, role, healthy=False))
                continue
            self.loads[wid] = load
            self.router.on_kv_events(wid, [KVEvent(KVEventKind(k), h, p) for k, h, p in load["events"]])
            self.router.update_load(WorkerLoad(wid, role, healthy=wid not in self._dead,
                                               queued_prefill_tokens=load["queued_prefill_tokens"],
                                               running_requests=load["running"], free_blocks=load["free_blocks"],
                                               total_blocks=load["total_blocks"]))

    async def _poll_loads(self) -> None:
        while not self._closing:
            await self._refresh()
            self._ready.set()
            await asyncio.sleep(self.poll_s)
