"""What the gateway saw happen to its workers, and how it restarts one it gave up on.

Shared by both backends: the disaggregated one (cluster/disagg_backend.py) and the
colocated one's watch (cluster/colocated_watch.py). The gateway exports the counts
(`pdserve:workers_lost_total` and the rest: docs/observability.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.cluster.worker_handle import WorkerHandle

log = logging.getLogger(__name__)


@dataclass
class WorkerEvents:
    """Counts of what the poller saw happen to workers (exported by the gateway)."""

    lost: int = 0  # a worker went from answering to not (its call or its poll failed)
    readmitted: int = 0  # a lost worker answered again (restarted, or a hiccup over)
    restarted: int = 0  # a worker answered from a new process (Ray restarted it)
    to_prefill: int = 0  # role switches that moved a worker into the prefill pool
    to_decode: int = 0  # ... into the decode pool
    switch_failures: int = 0  # role switches that failed
    stalled: int = 0  # workers given up on by the stall watch (held work, made no progress)


# How a stalled worker is restarted (given its handle): Ray's, `restart_actor`, by default.
Restart = Callable[[WorkerHandle], None]


def restart_actor(handle: WorkerHandle) -> None:
    """Kill the actor's process, letting Ray restart it (`max_restarts`). It works on a
    SIGSTOPped process too: the calls in flight on it failed ~6 s after the kill, and
    the new process answered from then (Ray 2.60, a local cluster, by hand)."""
    import ray

    ray.kill(handle, no_restart=False)


def restart_soon(restart: Restart, name: str, handle: WorkerHandle, tasks: set[asyncio.Task[None]],
                 failed: Callable[[], object] = lambda: None) -> None:
    """`restart(handle)` in a thread (`ray.kill` blocks), its task kept in `tasks` until it
    ends (the backend's close awaits them); `failed()` if it raised. A worker given up stays
    out of routing until it answers again, restarted or not (Ray may still restart it)."""
    async def run() -> None:
        try:
            await asyncio.to_thread(restart, handle)
        except Exception:  # noqa: BLE001 - logged; the worker stays out of routing until it answers
            log.exception("restarting stalled worker %s failed", name)
            failed()

    task = asyncio.create_task(run())
    tasks.add(task)
    task.add_done_callback(tasks.discard)
