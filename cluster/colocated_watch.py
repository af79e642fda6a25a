"""A colocated cluster's watch on its workers: the stall watch (cluster/stall_watch.py)
and the counts of workers lost, back and restarted, as the disaggregated backend has them.

A colocated worker that hangs without dying (SIGSTOP, a step that never returns) fails
no call: its requests waited for their deadline. Each worker is now polled for its load
(`progress`: its engine's snapshot, taken between two steps, without the prefix cache
`load` would bring), ten times per stall timeout (1 s at the
default 10 s): nothing routes by the polls here, so they need not come as often as the
disaggregated router's. A worker that holds work and answers nothing, or computes no
token, for the stall timeout is given up: out of routing, its tries fail with
WorkerStalledError (the gateway moves them on from the tokens their clients have), and
Ray restarts it. A poll that fails as a dead actor's call does takes the worker out of
routing as a failed try does; an answer puts it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from pdserve.cluster.reports import Progress
from pdserve.cluster.stall_watch import DEFAULT_MAX_TICK_GAP_S, Stall, StallWatch, WorkerStalledError
from pdserve.cluster.worker_events import Restart, WorkerEvents, restart_soon
from pdserve.cluster.worker_handle import WorkerHandle

log = logging.getLogger(__name__)

POLLS_PER_TIMEOUT = 10
_POLL_TIMEOUT_S = 5.0  # a poll not answered by then is a silence (the stall watch's), not a death


class WatchedPool(Protocol):
    """What the watch needs of the colocated backend (cluster/backend.py ColocatedBackend)."""

    def handles(self) -> dict[str, WorkerHandle | None]:
        """Worker name -> its handle (None while not found)."""
        ...

    def tries(self) -> dict[str, int]:
        """Worker name -> this gateway's tries in flight on it."""
        ...

    def down(self, name: str) -> None:
        """Out of routing until `up`: it failed a poll as a dead actor does, or was given up."""
        ...

    def up(self, name: str) -> None:
        """It answered a poll: routable."""
        ...

    def fail_tries(self, name: str, error: Callable[[], BaseException]) -> None:
        """Fail this gateway's tries on it now, each with a fresh `error()`: they move on."""
        ...


class ColocatedWatch:
    """Polls `pool`'s workers and gives up the stalled ones. Use on one event loop."""

    def __init__(self, pool: WatchedPool, timeout_s: float, restart: Restart, poll_s: float | None = None) -> None:
        self.pool = pool
        self.poll_s = poll_s if poll_s is not None else timeout_s / POLLS_PER_TIMEOUT
        self.tick_s = min(self.poll_s, timeout_s / 4)
        self.stalls = StallWatch(timeout_s, max_tick_gap_s=self.tick_s + DEFAULT_MAX_TICK_GAP_S)
        self.events = WorkerEvents()
        self._restart = restart
        self._answered: set[str] = set()  # answered a poll at least once
        self._lost: set[str] = set()  # answered once, then failed (until it answers again)
        self._incarnation: dict[str, str] = {}
        # The process each given-up worker answered from last: until its kill lands it may
        # still answer, and that is not the worker back (a new incarnation is).
        self._given_up: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._restarts: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._poll(name)) for name in self.pool.handles()]
            self._tasks.append(asyncio.create_task(self._watch()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in [*self._tasks, *self._restarts]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def lost(self, name: str) -> None:
        """A try or a poll found `name` dead."""
        if name in self._answered and name not in self._lost:
            self._lost.add(name)
            self.events.lost += 1
        self.pool.down(name)

    async def _poll(self, name: str) -> None:
        while True:
            handle = self.pool.handles().get(name)
            if handle is not None:
                await self._poll_once(name, handle)
            await asyncio.sleep(self.poll_s)

    async def _poll_once(self, name: str, handle: WorkerHandle) -> None:
        try:
            async with asyncio.timeout(_POLL_TIMEOUT_S):
                report: Progress = await handle.progress.remote()
        except TimeoutError:
            return  # silent: the stall watch counts it, if the worker holds work
        except Exception:  # noqa: BLE001 - dead or restarting (Ray's errors), or its engine failed
            self.stalls.forget(name, time.monotonic())  # no hang to watch for: Ray restarts it
            self.lost(name)
            return
        doomed = self._given_up.get(name)
        if doomed is not None:
            if report.incarnation == doomed:
                return
            del self._given_up[name]
        self.stalls.answered(name, time.monotonic(), report.snapshot)
        if name in self._lost:
            self._lost.discard(name)
            self.events.readmitted += 1
        self._answered.add(name)
        if self._incarnation.setdefault(name, report.incarnation) != report.incarnation:
            self._incarnation[name] = report.incarnation
            self.events.restarted += 1
        self.pool.up(name)

    async def _watch(self) -> None:
        while True:
            found = [name for name, handle in self.pool.handles().items() if handle is not None]
            for stall in self.stalls.check(time.monotonic(), self.pool.tries(), found):
                self._give_up(stall)
            await asyncio.sleep(self.tick_s)

    def _give_up(self, stall: Stall) -> None:
        name = stall.worker
        log.warning("worker %s stalled (%s): moving its requests and restarting it", name, stall.reason)
        self.events.stalled += 1
        if name in self._incarnation:
            self._given_up[name] = self._incarnation[name]
        self.lost(name)
        self.pool.fail_tries(name, lambda: WorkerStalledError(f"worker {name} stalled: {stall.reason}"))
        handle = self.pool.handles().get(name)
        if handle is not None:
            # Not killed if the restart fails: its own process may recover and answer.
            restart_soon(self._restart, name, handle, self._restarts, lambda: self._given_up.pop(name, None))
