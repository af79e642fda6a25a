"""The gateway's coordinator for disaggregated serving.

One request: the router picks a prefill and a decode worker and a plan; one
call runs it, and every token comes back on the gateway's token stream:

    LOCAL         decode.serve(req)                      the decode worker prefills it too
    HANDOFF       decode.handoff(req, prefill)           it reserves blocks, the prefill worker
                                                         computes the prompt into them, it decodes
    PREFILL_ONLY  prefill.serve(req)                     ends at its first token: no decode worker
                                                         (if the prefill worker is gone: decode.serve)

Any exit before the end (client gone, deadline, worker error) aborts the
request on both workers, which frees its blocks on both sides. Worker loads and
KV events reach the router from a poller every `poll_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError

from pdserve.cluster.backend import TokenStreams, _abort
from pdserve.cluster.metrics import WorkerHandles
from pdserve.cluster.reports import LoadReport
from pdserve.cluster.router import Router
from pdserve.cluster.router.policy import Plan, RoutingDecision, WorkerLoad, WorkerRole
from pdserve.cluster.router.router import RouterStats
from pdserve.workers.handoff import ServeRequest
from pdserve.workers.messages import KVEventBatch
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import SamplingParams

# The router knows no worker until the first poll has answered; a worker that
# takes longer than this to report is taken for dead (until it answers again).
_FIRST_POLL_S = 30.0
_POLL_TIMEOUT_S = 5.0


class DisaggregatedBackend:
    def __init__(self, prefill: dict[str, Any], decode: dict[str, Any], router: Router, poll_s: float = 0.05,
                 stream_host: str = "127.0.0.1", names: dict[str, str] | None = None) -> None:
        """`prefill`/`decode`: router worker id -> actor handle; `names`: router
        worker id -> actor name (the `worker` label of its metrics; default the id)."""
        self.prefill, self.decode, self.router = prefill, decode, router
        self.names = names or {}
        self.streams = TokenStreams(stream_host)
        self.poll_s = poll_s
        self.loads: dict[str, LoadReport] = {}
        self._in_flight = 0
        self._dead: set[str] = set()
        self._event_seq: dict[str, int] = {}  # the next KV event batch each worker should send
        self._poller: asyncio.Task[None] | None = None
        self._ready: asyncio.Event | None = None
        self._closing = False

    @property
    def healthy(self) -> bool:
        return any(w not in self._dead for w in self.decode) and (
            any(w not in self._dead for w in self.prefill) or not self.prefill)

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def worker_handles(self) -> WorkerHandles:
        pools = [("prefill", self.prefill), ("decode", self.decode)]
        return {self.names.get(wid, wid): (pool, h) for pool, handles in pools for wid, h in handles.items()}

    def router_stats(self) -> RouterStats | None:
        return self.router.stats

    async def start(self) -> None:
        """Start polling worker loads; returns once the first poll has answered."""
        if self._poller is None:
            self._closing = False
            self._ready = asyncio.Event()
            self._poller = asyncio.create_task(self._poll_loads(self._ready))
        assert self._ready is not None
        await asyncio.wait_for(self._ready.wait(), timeout=_FIRST_POLL_S)

    async def close(self) -> None:
        await self.streams.close()
        self._closing = True  # Python 3.11's wait_for can swallow a cancel: the poll loop checks this too
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        await self.start()
        decision = self.router.route(request_id, prompt, params.max_tokens)
        req = self.streams.request(request_id, prompt, params, timeout_s)
        self._in_flight += 1
        try:
            async for out in self.streams.run(req, lambda: self._run(decision, req),
                                              lambda: self._abort(decision, request_id)):
                yield out
        finally:
            self._in_flight -= 1

    async def _run(self, decision: RoutingDecision, req: ServeRequest) -> None:
        """The one call that runs the request, by its plan."""
        decode = self.decode[decision.decode_worker]
        p_id = decision.prefill_worker
        if decision.plan is Plan.LOCAL or p_id is None:
            await decode.serve.remote(req)
        elif decision.plan is Plan.HANDOFF:
            await decode.handoff.remote(req, self.prefill[p_id])
        else:
            try:
                await self.prefill[p_id].serve.remote(req)
            except RayActorError:  # it is gone: the decode worker runs the request
                self._dead.add(p_id)
                await decode.serve.remote(req)

    def _abort(self, decision: RoutingDecision, request_id: str) -> None:
        _abort(self.decode[decision.decode_worker], request_id)
        if decision.prefill_worker is not None:
            _abort(self.prefill[decision.prefill_worker], request_id)

    # -- loads and KV events -----------------------------------------------------

    async def _poll_loads(self, ready: asyncio.Event) -> None:
        while not self._closing:
            await self._refresh()
            ready.set()
            await asyncio.sleep(self.poll_s)

    async def _refresh(self) -> None:
        workers = {**{k: (v, WorkerRole.PREFILL) for k, v in self.prefill.items()},
                   **{k: (v, WorkerRole.DECODE) for k, v in self.decode.items()}}
        for wid, (actor, role) in workers.items():
            try:
                report: LoadReport = await asyncio.wait_for(actor.load.remote(), timeout=_POLL_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - dead, hung, or its engine failed: not routable
                self._dead.add(wid)
                self.router.update_load(WorkerLoad(wid, role, healthy=False))
                continue
            self._dead.discard(wid)  # it answers: routable again (a restarted worker, a hiccup)
            self.loads[wid] = report
            self._apply_events(wid, report.events)
            s = report.snapshot
            self.router.update_load(WorkerLoad(wid, role, healthy=True,
                                               queued_prefill_tokens=s.queued_prefill_tokens,
                                               running_requests=s.running, free_blocks=s.free_blocks,
                                               total_blocks=s.total_blocks))

    def _apply_events(self, wid: str, batch: KVEventBatch) -> None:
        if batch.batch_seq != self._event_seq.get(wid, 0):
            self.router.forget_cache(wid)  # a batch was lost: what it caches is unknown; relearn it
        self._event_seq[wid] = batch.batch_seq + 1
        self.router.on_kv_events(wid, batch.events)
