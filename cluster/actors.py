"""The worker services the cluster runs as Ray actors (cluster/ray_actors.py makes them).

Each service is a plain class over a Ray-free worker, importable without Ray (tests,
and a lent GPU's served check, drive them in one process). Nothing here decides
anything: routing is the router's, scheduling the engine's. What crosses Ray is
typed: `ServeRequest`, `PrefillOrder` and `FirstToken` (workers/handoff.py),
`WorkerInfo` and `LoadReport` (cluster/reports.py); tokens go to the gateway's
token stream, never through these calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time

from pdserve.cluster.placement import bind_host
from pdserve.cluster.ray_errors import RayActorError
from pdserve.cluster.reports import DrainState, LoadReport, Progress, RoleSwitch, WorkerInfo
from pdserve.cluster.role_switch import RoleSwitcher
from pdserve.cluster.roles import DecodeRole, PrefillRole, Role, RoleContext, RoleSettings, make_role
from pdserve.cluster.router.policy import WorkerRole
from pdserve.cluster.worker_handle import PrefillHandle
from pdserve.cluster.worker_inbox import Outcomes, WorkerInbox
from pdserve.cluster.worker_metrics import Pool, WorkerCounts, WorkerMetrics
from pdserve.workers import fault_seam
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.config import EngineConfig, SpeculativeMethod
from pdserve.workers.cpu_threads import run_on_exiting_thread
from pdserve.workers.cpu_turns import node_cores
from pdserve.workers.decode_worker import DecodeWorker, PeerFailedError
from pdserve.workers.engine import LLMEngine
from pdserve.workers.handoff import FirstToken, KVFailurePolicy, PrefillOrder, ServeRequest
from pdserve.workers.inbox_wire import StartTry
from pdserve.workers.kv.event_log import EventCursor, EventSlice
from pdserve.workers.messages import KVEventBatch
from pdserve.workers.prefill_worker import DEFAULT_TRANSFER_TIMEOUT_S, PrefillWorker
from pdserve.workers.stats import EngineSnapshot
from pdserve.workers.token_stream import StreamLostError
from pdserve.workers.transfer import auth
from pdserve.workers.transfer.auth import ClusterSecret
from pdserve.workers.transfer.base import KVReceiver, Transport

logger = logging.getLogger(__name__)

# After its engine thread died, a worker process lives this long (the errors
# already sent reach their callers), then exits so that Ray restarts it.
_EXIT_DELAY_S = 0.5
_EXIT_CODE = 70  # EX_SOFTWARE

# A scrape waits this long for the engine thread to sample its counters; past
# it (a long step), the last sample goes out with the current step histograms.
_SAMPLE_TIMEOUT_S = 1.0


class _Service:
    """What every worker service answers: its info, its load, its metrics, aborts."""

    def __init__(self, pool: Pool, engine: LLMEngine, async_engine: AsyncEngine, worker_name: str,
                 exit_on_engine_death: bool, secret: ClusterSecret, inbox_host: str | None) -> None:
        self.pool, self.name = pool, worker_name
        self.engine, self.async_engine = engine, async_engine
        self.worker_metrics = WorkerMetrics(pool, worker_name, engine.config.num_speculative_tokens, self.counts)
        self.worker_metrics.attach(engine)
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        # Where gateways start requests (cluster/worker_inbox.py): bound on the first call, on
        # the actor's event loop; on this node's address for the kv_host setting.
        self.inbox = WorkerInbox(self._run_try, async_engine.abort, secret, bind_host(inbox_host), self.incarnation,
                                 engine_error=lambda: async_engine.error)
        if exit_on_engine_death:
            async_engine.on_dead = _exit_soon

    async def info(self) -> WorkerInfo:
        return WorkerInfo(self.engine.num_kv_blocks, self.engine.max_model_len, dtype=_dtype_name(self.engine),
                          pid=os.getpid(), fixed_cpu_threads=_fixed_cpu_threads(self.engine, self.async_engine),
                          tensor_parallel_size=self.engine.tp.size, inbox=self.inbox.open(),
                          incarnation=self.incarnation)

    async def outcomes(self, gateway: str, after: int, timeout_s: float) -> Outcomes:
        """What became of `gateway`'s tries here, reported after report `after` (a long poll:
        cluster/worker_inbox.py); Ray fails the call when this process dies."""
        return await self.inbox.outcomes(gateway, after, timeout_s)

    async def _run_try(self, start: StartTry) -> None:
        """A try the inbox received (the request's Ray call, before: `serve`)."""
        await self.serve(start.request)

    async def serve(self, req: ServeRequest) -> None:
        raise NotImplementedError

    async def abort(self, request_id: str, attempt: int | None = None) -> None:
        """End the request here (only its try `attempt` or an earlier one, when given): in the
        engine, and a try the inbox started that has not reached it yet."""
        self.inbox.abort(request_id, attempt)

    async def load(self, since: EventCursor | None = None) -> LoadReport:
        """The engine's load, and its prefix-cache events from `since` on (the cursor the
        caller's last report gave it; None: a new caller), or a snapshot of its prefix
        cache where those events are no longer kept (workers/kv/event_log.py). Reads
        consume nothing: any number of gateways poll alike. Both on the engine thread,
        so the snapshot stands exactly at its seq."""
        if since is not None and not isinstance(since, EventCursor):
            raise ValueError(f"since: an EventCursor or None, got {type(since).__name__}")

        def read(e: LLMEngine) -> tuple[EngineSnapshot, EventSlice]:
            return e.snapshot(), e.kv.pool.read_events(since)

        # The message is built (and checked) here, not on the engine thread: a snapshot
        # of a big cache takes a while to check.
        snapshot, events = await self.async_engine.call(read)
        return self._report(snapshot, KVEventBatch.of(self.name, events))

    async def progress(self) -> Progress:
        """The engine's snapshot (on its engine thread, between two steps) and this process's
        incarnation: `load` without the prefix cache."""
        snapshot: EngineSnapshot = await self.async_engine.call(lambda e: e.snapshot())
        return Progress(snapshot, self.incarnation)

    def _report(self, snapshot: EngineSnapshot, events: KVEventBatch) -> LoadReport:
        return LoadReport(snapshot, events, self.incarnation)

    async def metrics(self) -> bytes:
        """This worker's Prometheus exposition (the gateway merges every worker's)."""
        with contextlib.suppress(TimeoutError):
            await self.async_engine.call(self.worker_metrics.sample, timeout_s=_SAMPLE_TIMEOUT_S)
        return self.worker_metrics.render()

    async def drain_state(self) -> DrainState:
        """What this worker still holds (engine thread: a consistent view)."""
        def read(e: LLMEngine) -> tuple[int, int]:
            return len(e.scheduler.requests), e.kv.pool.num_used

        requests, used = await self.async_engine.call(read)
        return DrainState(self.async_engine.num_in_flight, requests, used, self._registrations(),
                          len(asyncio.all_tasks()), threading.active_count(),
                          self.async_engine.num_orphans_aborted, self.incarnation)

    def _registrations(self) -> int:
        return 0

    def counts(self) -> WorkerCounts:
        """Its failure counters now (its metrics export them at each scrape)."""
        inbox: WorkerInbox | None = getattr(self, "inbox", None)  # the metrics ask before it exists
        refused = (0, 0, 0) if inbox is None else (inbox.num_forged, inbox.num_replayed, inbox.num_rejected)
        return WorkerCounts(orphans_aborted=self.async_engine.num_orphans_aborted, inbox_refused=refused)

    async def inject_fault(self, kind: str) -> None:
        """The test seam's way into a worker (workers/fault_seam.py; the chaos tests):
        `engine_crash` makes the engine thread fail as a bug would, `poison_row` one running
        request's row of every step (the engine fails that request alone). Refused
        (PermissionError) unless the worker was started with PDSERVE_FAULT_INJECTION=1."""
        fault = fault_seam.worker_fault(kind)
        if fault is fault_seam.WorkerFault.ENGINE_CRASH:
            self.async_engine.post(fault_seam.crash_engine)
        elif fault is fault_seam.WorkerFault.POISON_ROW:
            engine = self.engine

            def poison() -> None:
                fault_seam.poison_row(engine)

            self.async_engine.post(poison)

    def close(self) -> None:
        """Stop the engine thread (requests in flight fail) and the transport."""
        self.inbox.close()
        self.async_engine.close()


class EngineService(_Service):
    """A colocated worker: prefills and decodes. Async actor: many requests
    stream through it at once while its engine thread batches them.

    Every service takes the cluster's `cluster_secret` (workers/transfer/auth.py):
    its token streams and KV links are signed with it (None: PDSERVE_CLUSTER_SECRET,
    else a secret of this process's own, which no other process shares)."""

    def __init__(self, config: EngineConfig, torch_threads: int, worker_name: str = "worker",
                 exit_on_engine_death: bool = False, cluster_secret: ClusterSecret | None = None,
                 kv_host: str | None = None) -> None:
        secret = _use_secret(cluster_secret)
        engine = _engine(config, torch_threads)
        super().__init__(Pool.COLOCATED, engine, AsyncEngine(engine, worker_id=worker_name).start(), worker_name,
                         exit_on_engine_death, secret, kv_host)

    async def serve(self, req: ServeRequest) -> None:
        """Run `req`; its tokens go to `req.reply_to`. Returns when it is over, raises its error."""
        await self.async_engine.serve(req)


class WorkerService(_Service):
    """A disaggregated worker: one engine, loaded once, and one role at a time
    (prefill or decode: cluster/roles.py), which `switch_role` changes while the
    worker serves, without reloading the model or restarting the process.

    A prefill role computes prompts and streams their KV to decode workers; a
    decode role drives each request's handoff (reserve, prefill elsewhere, receive
    the KV) and decodes in a continuous batch, or serves a request end to end
    (local prefill) when the router says so. A call for the role it does not hold
    (now, or while it switches) raises WorkerDrainingError: the gateway moves the
    request on (a decode worker whose prefill worker left computes the prompt itself).

    `settings` holds both roles' settings: the gateway's switch names only the role."""

    def __init__(self, config: EngineConfig, torch_threads: int, role: WorkerRole,
                 settings: RoleSettings | None = None, worker_name: str = "worker",
                 exit_on_engine_death: bool = False, cluster_secret: ClusterSecret | None = None) -> None:
        secret = _use_secret(cluster_secret)
        settings = settings or RoleSettings()
        self.config = config  # as given: a decode role decodes speculatively if the engine could
        # A prefill worker drafts nothing until it switches to decode. An n-gram speculator costs
        # nothing to hold, so it keeps one (and the memory plan and CUDA graphs that go with it):
        # after a switch it decodes speculatively as a decode-born worker does. A draft model is a
        # second model in its memory: not loaded for a worker born to prefill.
        if role is WorkerRole.PREFILL and config.speculative is SpeculativeMethod.DRAFT:
            config = dataclasses.replace(config, speculative=None, draft_model=None)
        engine = _engine(config, torch_threads, record_events=True)
        super().__init__(Pool(role.value), engine, AsyncEngine(engine, worker_id=worker_name), worker_name,
                         exit_on_engine_death, secret, settings.kv_host)
        self.ctx = RoleContext(engine, self.async_engine, settings, secret, worker_name)
        self.role: Role = make_role(role, self.ctx, self.worker_metrics)
        self.switcher = RoleSwitcher(self)
        self.peers: dict[str, PrefillHandle] = {}  # prefill workers by name (`meet`)
        self.async_engine.start()

    @property
    def worker(self) -> PrefillWorker | DecodeWorker:
        """The current role's worker (workers/prefill_worker.py or decode_worker.py)."""
        return self.role.worker

    @property
    def receiver(self) -> KVReceiver:
        """The decode role's KV receiver (AttributeError in the prefill role)."""
        if not isinstance(self.role, DecodeRole):
            raise AttributeError(f"worker {self.name} is a prefill worker now: it has no KV receiver")
        return self.role.receiver

    async def info(self) -> WorkerInfo:
        return dataclasses.replace(await super().info(), kv_address=self.role.kv_address, role=self.role.role)

    def _report(self, snapshot: EngineSnapshot, events: KVEventBatch) -> LoadReport:
        role, switching, epoch = self.switcher.status
        return LoadReport(snapshot, events, self.incarnation, role, switching, epoch)

    def _registrations(self) -> int:
        return self.role.registrations()

    def counts(self) -> WorkerCounts:
        # Called by the metrics before the first role exists (WorkerMetrics takes it at once).
        role: Role | None = getattr(self, "role", None)
        base = super().counts()
        return base if role is None else role.counts(base)

    async def prefill(self, order: PrefillOrder) -> FirstToken:
        """Prefill into a decode worker's reserved blocks; the first token once its KV is verified there."""
        async with self.switcher.call(WorkerRole.PREFILL) as role:
            assert isinstance(role, PrefillRole)
            return await role.worker.prefill(order)

    async def serve(self, req: ServeRequest) -> None:
        """The whole request here: a decode worker's local prefill, or a request that ends
        at its first token on a prefill worker (no handoff)."""
        wants = WorkerRole.PREFILL if req.params.max_tokens == 1 and self.role.role is WorkerRole.PREFILL \
            else WorkerRole.DECODE
        async with self.switcher.call(wants) as role:
            await role.worker.serve(req)

    async def meet(self, name: str, handle: PrefillHandle) -> None:
        """Keep a prefill worker's handle: a handoff started on the inbox names it (a
        gateway introduces each prefill worker once per life of this worker)."""
        if not isinstance(name, str) or not name:
            raise ValueError("name: a prefill worker's name")
        self.peers[name] = handle

    async def _run_try(self, start: StartTry) -> None:
        if start.prefill_worker is None:
            await self.serve(start.request)
            return
        peer = self.peers.get(start.prefill_worker)
        if peer is None:  # the gateway meets a worker before it names the peer: another life answered
            raise StreamLostError(f"prefill worker {start.prefill_worker!r} is unknown here")
        await self.handoff(start.request, peer)

    async def handoff(self, req: ServeRequest, prefill: PrefillHandle) -> None:
        """`req` prefilled by the prefill worker `prefill` (an actor handle), decoded here."""
        async with self.switcher.call(WorkerRole.DECODE) as role:
            assert isinstance(role, DecodeRole)
            await role.worker.handoff(req, RayPrefillPeer(prefill))

    async def switch_role(self, role: WorkerRole, drain_timeout_s: float) -> RoleSwitch:
        """Take `role` (cluster/role_switch.py: drain, cut what is left, free every block
        and the prefix cache, build the new role). ValueError for a role a disaggregated
        worker cannot hold or while a switch is under way; returns what it did."""
        return await self.switcher.switch(role, drain_timeout_s)

    def close(self) -> None:
        super().close()
        self.role.close()


class PrefillService(WorkerService):
    """A worker that starts as a prefill worker (it may change role later: `switch_role`).
    The decode role's settings (`kv_host`, `on_kv_failure`, `prefill_timeout_s`) are
    used only if it does."""

    def __init__(self, config: EngineConfig, torch_threads: int, transport: Transport = Transport.ZMQ,
                 transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S, worker_name: str = "prefill",
                 exit_on_engine_death: bool = False, cluster_secret: ClusterSecret | None = None,
                 kv_host: str | None = None, on_kv_failure: KVFailurePolicy = KVFailurePolicy.RECOMPUTE,
                 prefill_timeout_s: float | None = None) -> None:
        settings = RoleSettings(transport, transfer_timeout_s, kv_host, on_kv_failure, prefill_timeout_s)
        super().__init__(config, torch_threads, WorkerRole.PREFILL, settings, worker_name, exit_on_engine_death,
                         cluster_secret)


class DecodeService(WorkerService):
    """A worker that starts as a decode worker (it may change role later: `switch_role`).
    `transfer_timeout_s` is the prefill role's, used only if it does."""

    def __init__(self, config: EngineConfig, torch_threads: int, kv_host: str | None,
                 transport: Transport = Transport.ZMQ, on_kv_failure: KVFailurePolicy = KVFailurePolicy.RECOMPUTE,
                 prefill_timeout_s: float | None = None, worker_name: str = "decode",
                 exit_on_engine_death: bool = False, cluster_secret: ClusterSecret | None = None,
                 transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S) -> None:
        settings = RoleSettings(transport, transfer_timeout_s, kv_host, on_kv_failure, prefill_timeout_s)
        super().__init__(config, torch_threads, WorkerRole.DECODE, settings, worker_name, exit_on_engine_death,
                         cluster_secret)


class RayPrefillPeer:
    """A prefill worker's actor handle as a decode worker's `PrefillPeer`."""

    def __init__(self, handle: PrefillHandle) -> None:
        self._handle = handle

    async def prefill(self, order: PrefillOrder) -> FirstToken:
        try:
            first: FirstToken = await self._handle.prefill.remote(order)
        except RayActorError as e:
            raise PeerFailedError(f"the prefill worker is gone: {e}") from None
        return first

    def abort(self, request_id: str, attempt: int) -> None:
        with contextlib.suppress(RayActorError):
            self._handle.abort.remote(request_id, attempt)  # fire and forget


def _use_secret(secret: ClusterSecret | None) -> ClusterSecret:
    """The cluster secret this worker signs with, made this process's default too: the engine's token
    stream publisher (workers/async_engine.py) takes the default."""
    if secret is not None:
        auth.set_default_secret(secret)
    return auth.default_secret()


def _exit_soon(error: BaseException) -> None:
    """The engine thread died: this process can run nothing, though Ray would still
    see a live actor. Exit (after the failed requests' errors went out), so that Ray
    restarts it (`max_restarts`) and the gateway routes to the new one."""
    logger.error("engine thread failed (%r): exiting in %.1f s to be restarted", error, _EXIT_DELAY_S)
    timer = threading.Timer(_EXIT_DELAY_S, os._exit, args=(_EXIT_CODE,))
    timer.daemon = True
    timer.start()


def _fixed_cpu_threads(engine: LLMEngine, async_engine: AsyncEngine) -> int:
    """The engine's torch threads where they are a fixed share of a CPU node (cluster/cpu_pinning.py):
    every rank's, for a tensor-parallel engine (each steps on its part of the share)."""
    if engine.device.type != "cpu" or engine.shares_cores_by_step:
        return 0
    return async_engine.torch_threads * engine.tp.size


def _dtype_name(engine: LLMEngine) -> str:
    return str(engine.dtype).removeprefix("torch.")


def _engine(config: EngineConfig, torch_threads: int, record_events: bool = False) -> LLMEngine:
    import torch

    # Workers share the node's cores: more threads than cores makes OpenMP
    # threads spin against each other (docs/performance.md). Set here too:
    # the AsyncEngine's thread takes this thread's count. Workers that take turns
    # (workers/cpu_turns.py) each run on all of this node's cores, and no more; so
    # does a lending worker's share (workers/cpu_lending.py).
    if config.cpu_turns is not None or config.cpu_lending is not None:
        torch_threads = max(1, min(torch_threads, node_cores()))
    torch.set_num_threads(torch_threads)
    # Built on a thread that exits: the engine thread is then this process's only
    # OpenMP master, and its workers spin instead of sleeping (workers/cpu_threads.py).
    return run_on_exiting_thread(lambda: LLMEngine(dataclasses.replace(config, record_kv_events=record_events)),
                                 torch_threads)

