"""The two roles of a disaggregated worker, each built around an engine that is
already loaded and its running engine thread (a worker that changes role keeps
both: the weights stay, the process lives on).

A role holds only what its job needs beyond the engine: the prefill role its
KV senders (one link per decode worker) and first-token publisher, the decode
role its KV receiver bound on the kv_host. `close` frees those and leaves the
engine alone; `WorkerService` (cluster/actors.py) decides when.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.cluster.placement import bind_host
from pdserve.cluster.router.policy import WorkerRole
from pdserve.cluster.worker_metrics import Pool, WorkerCounts, WorkerMetrics
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.decode_worker import DecodeWorker
from pdserve.workers.engine import LLMEngine
from pdserve.workers.handoff import KVFailurePolicy
from pdserve.workers.prefill_worker import DEFAULT_TRANSFER_TIMEOUT_S, PrefillWorker
from pdserve.workers.transfer import auth
from pdserve.workers.transfer.auth import ClusterSecret
from pdserve.workers.transfer.base import KVReceiver, KVSender, Transport
from pdserve.workers.transfer.fingerprint import module_fingerprint


@dataclass(frozen=True)
class RoleSettings:
    """What the roles need beyond the engine. A worker that may change role holds both
    roles' settings from its start (the gateway's switch names only the role)."""

    transport: Transport = Transport.ZMQ
    # prefill: the longest one send may wait on its decode worker (a credit, the verdict)
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    kv_host: str | None = None  # decode: the kv_host setting its KV receiver binds (cluster/placement.py)
    on_kv_failure: KVFailurePolicy = KVFailurePolicy.RECOMPUTE  # decode: when a handoff's KV fails
    prefill_timeout_s: float | None = None  # decode: a remote prefill's budget (None: the request's deadline)


@dataclass(frozen=True)
class RoleContext:
    """The worker's parts every role is built on (they outlive any one role)."""

    engine: LLMEngine
    async_engine: AsyncEngine
    settings: RoleSettings
    secret: ClusterSecret
    worker_name: str


class PrefillRole:
    """Computes prompts and streams their KV to decode workers (workers/prefill_worker.py)."""

    role, pool = WorkerRole.PREFILL, Pool.PREFILL

    def __init__(self, ctx: RoleContext, metrics: WorkerMetrics) -> None:
        engine, secret = ctx.engine, ctx.secret
        sender_cls = sender_class(ctx.settings.transport)
        fingerprint = module_fingerprint(engine.model_dir, engine.model)
        kv = engine.transfer_kv  # now: a worker whose KV cannot travel fails to take the role

        def sender_for(address: str) -> KVSender:  # the worker keeps one per link, and closes it
            return sender_cls(kv, address, secret=secret, fingerprint=fingerprint)

        self.worker = PrefillWorker(engine, sender_for, metrics, worker_id=ctx.worker_name,
                                    transfer_timeout_s=ctx.settings.transfer_timeout_s, secret=secret,
                                    async_engine=ctx.async_engine)

    @property
    def kv_address(self) -> str | None:
        return None

    def registrations(self) -> int:
        return 0

    def counts(self, base: WorkerCounts) -> WorkerCounts:
        links = self.worker.link_counts()
        return dataclasses.replace(base, link_resyncs=links.resyncs, links_lost=links.links_lost,
                                   dataplane_refused=links.refused)

    def close(self) -> None:
        self.worker.close_role()


class DecodeRole:
    """Reserves blocks, has a prefill worker fill them, decodes in a continuous batch
    (workers/decode_worker.py); its KV receiver binds the kv_host on this node."""

    role, pool = WorkerRole.DECODE, Pool.DECODE

    def __init__(self, ctx: RoleContext, metrics: WorkerMetrics) -> None:
        engine, s = ctx.engine, ctx.settings
        host = bind_host(s.kv_host)  # this node's address when prefill workers may be on other nodes
        self.receiver = receiver_class(s.transport)(engine.transfer_kv, bind=f"tcp://{host}:*", secret=ctx.secret,
                                                    fingerprint=module_fingerprint(engine.model_dir, engine.model))
        self.worker = DecodeWorker(engine, self.receiver, s.on_kv_failure, metrics, worker_id=ctx.worker_name,
                                   prefill_timeout_s=s.prefill_timeout_s, async_engine=ctx.async_engine)

    @property
    def kv_address(self) -> str | None:
        return self.receiver.address

    def registrations(self) -> int:
        return int(getattr(self.receiver, "num_registered", 0))

    def counts(self, base: WorkerCounts) -> WorkerCounts:
        refused = getattr(self.receiver, "refusals", None) or auth.RefusalCounts()  # a network receiver's
        return dataclasses.replace(base, awaiting_kv=self.registrations(),
                                   leases_expired=self.worker.num_leases_expired,
                                   dataplane_refused=refused.add(auth.RefusalCounts()))  # a copy, now

    def close(self) -> None:
        self.worker.close_role()
        self.receiver.close()


# What a worker holds, one at a time. Each has: `role`, `pool`, `worker`, `kv_address` (a decode
# role's receiver, where prefill workers send), `registrations()` (transfers it still expects),
# `counts(base)` (its failure counters), `close()` (frees its threads and sockets, not the
# engine; joins threads, each bounded: call it off the event loop).
Role = PrefillRole | DecodeRole


def make_role(role: WorkerRole, ctx: RoleContext, metrics: WorkerMetrics) -> Role:
    if role is WorkerRole.PREFILL:
        return PrefillRole(ctx, metrics)
    if role is WorkerRole.DECODE:
        return DecodeRole(ctx, metrics)
    raise ValueError(f"role: a disaggregated worker is prefill or decode, got {role.value}")


def sender_class(transport: Transport) -> Callable[..., KVSender]:
    """ZeroMQ for any two hosts; NCCL between GPUs (gloo, the same code path, when
    the caches are on the CPU)."""
    if transport is Transport.NCCL:
        from pdserve.workers.transfer.nccl_backend import NcclKVSender

        return NcclKVSender
    from pdserve.workers.transfer.zmq_backend import ZmqKVSender

    return ZmqKVSender


def receiver_class(transport: Transport) -> Callable[..., KVReceiver]:
    if transport is Transport.NCCL:
        from pdserve.workers.transfer.nccl_backend import NcclKVReceiver

        return NcclKVReceiver
    from pdserve.workers.transfer.zmq_backend import ZmqKVReceiver

    return ZmqKVReceiver
