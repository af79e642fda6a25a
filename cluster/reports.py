"""What workers tell the gateway: who they are (`WorkerInfo`, once) and how
loaded they are, with what entered and left their prefix caches (`LoadReport`,
on every poll; reading one consumes nothing, so gateway replicas all see the
same). Frozen and typed: the gateway reads fields, not dict keys."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster.router.policy import WorkerRole
from pdserve.workers.messages import KVEventBatch
from pdserve.workers.stats import EngineSnapshot


@dataclass(frozen=True)
class WorkerInfo:
    num_kv_blocks: int
    max_model_len: int
    kv_address: str | None = None  # a decode worker's KV receiver (where prefill workers send)
    role: WorkerRole | None = None  # what it does now (None: a worker that cannot change role)
    dtype: str = ""  # what its engine computes in ("bfloat16": `--dtype auto` resolved on its device)
    pid: int = 0  # its process
    # Torch threads of a CPU engine with a fixed share of the node's cores (split sharing);
    # 0 on a GPU, or where its engines lend cores or take turns at them (they need them all).
    fixed_cpu_threads: int = 0
    tensor_parallel_size: int = 1  # its engine's ranks (processes it started: workers/tp_group.py)
    inbox: str | None = None  # where gateways start its requests (cluster/worker_inbox.py)
    incarnation: str = ""  # which life of the worker process answered


@dataclass(frozen=True)
class DrainState:
    """What a worker still holds (the chaos suite reads it once the load is over:
    everything but the thread and task counts should be 0 then)."""

    jobs: int  # requests this worker's AsyncEngine tracks
    engine_requests: int  # requests in the engine (queued, running, held, awaiting KV)
    used_blocks: int  # KV blocks referenced (free and cached-but-evictable ones do not count)
    kv_registrations: int  # a decode worker's receiver: transfers it still expects
    tasks: int  # asyncio tasks on the actor's event loop
    threads: int  # threads in the worker process
    orphans_aborted: int  # requests aborted because their gateway was gone
    incarnation: str  # which life of the worker process answered

    @property
    def drained(self) -> bool:
        return not (self.jobs or self.engine_requests or self.used_blocks or self.kv_registrations)


@dataclass(frozen=True)
class Progress:
    """A worker's engine snapshot and incarnation, without its prefix cache: what the
    colocated stall watch polls (cluster/colocated_watch.py), where nothing routes by the
    cache and a pool that records no events would send all of it each time."""

    snapshot: EngineSnapshot
    incarnation: str


@dataclass(frozen=True)
class LoadReport:
    snapshot: EngineSnapshot  # taken on the worker's engine thread
    # Prefix-cache events from the cursor the caller sent, or a snapshot of the cache
    # (workers/kv/event_log.py): every caller sees every event. The rest of a report is
    # state and cumulative counters, so it too reads alike for any number of callers.
    events: KVEventBatch
    # Which life of the worker process answered (its pid and start time): a new one
    # means the worker was restarted (the gateway counts restarts by it).
    incarnation: str = ""
    # What the worker does now (None: a worker that cannot change role), and whether it is
    # changing role: then it takes no new work, and a gateway routes nothing to it.
    role: WorkerRole | None = None
    switching: bool = False
    role_epoch: int = 0  # the role switches this worker process has made (orders its reports' roles)


@dataclass(frozen=True)
class RoleSwitch:
    """What a worker's role switch did (`WorkerService.switch_role`)."""

    from_role: WorkerRole
    to_role: WorkerRole
    drained: int  # requests that finished here during the drain
    migrated: int  # requests cut at the drain's deadline (the gateway moved them on)
    duration_s: float
    speculative: bool  # a decode role: whether it decodes speculatively (False: the engine has no draft)
    incarnation: str = ""  # the worker process that switched
    epoch: int = 0  # its role switches so far, this one included (`LoadReport.role_epoch`)
