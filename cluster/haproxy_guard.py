"""A dead HAProxy started again by the actor that owns it, within a second.

Ray Serve's HAProxy manager actor starts HAProxy as its child and keeps the process
(`HAProxyApi._proc`); when HAProxy dies, Serve's controller notices only through the
manager's health checks (3 failures in a row, 1.5 s apart here: cluster/ingress.py)
and then replaces the whole manager: a new actor, a new worker process, its imports,
HAProxy. On a loaded 2-core machine that took 7.4-31 s.

This guard runs inside the manager, on its event loop, installed once by the driver
(cluster/ingress_watch.py). It looks at the child's exit status every POLL_S (set by
asyncio's child watcher as the child exits; no system call here), and when the
process the manager holds has exited without a reload having replaced it or a stop
having been asked for, it calls the manager's own `HAProxyApi.start` (config written
again, the wrapper, HAProxy) under the manager's reload lock. Why in the manager and
not from the driver: an earlier version asked the manager from `pdserve serve`'s
process through an actor call, which took 2.8-4.5 s under load; by then Serve's
controller had begun a replacement manager, the two HAProxys fought for the ports
("Address already in use"), and a repeat call could start a second HAProxy while
the first was still coming up. Here nothing crosses a process, and starts are
serialized with reloads and with each other by the lock.

What it leaves to Ray: a manager whose first start failed, and one whose restarts
keep failing (its health checks fail and the controller replaces it, guard and all).
A HAProxy that starts and then dies again within STABLE_S is started again after a wait
that doubles with each such death (BACKOFF_S up to MAX_BACKOFF_S): restarted at once each
time, one that crashed on its first request made the manager spawn it ~10 times a second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

GUARD_ATTR = "_pdserve_haproxy_guard"  # where the manager actor keeps its guard
POLL_S = 0.1  # how often the child's exit status is read: the restart starts within this
BACKOFF_S = 1.0  # between failed starts, and the first wait before restarting one that died soon after its start
MAX_BACKOFF_S = 30.0  # the longest wait before a restart
STABLE_S = 10.0  # a HAProxy that ran this long before dying is restarted at once


class HAProxyGuard:
    """Restarts the manager's HAProxy when its process has died (`run` on the manager's loop).

    `manager` is Ray Serve's HAProxyManager (or a stand-in with the same few members):
    `_haproxy` (the HAProxyApi: `_proc`, `start`, `stop`), `_reload_lock`,
    `_haproxy_start_task`, `event_loop`."""

    def __init__(self, manager: Any, poll_s: float = POLL_S, backoff_s: float = BACKOFF_S) -> None:
        self.manager, self.api = manager, manager._haproxy
        self.poll_s, self.backoff_s = poll_s, backoff_s
        self.restarts = 0  # HAProxys this guard started
        self.failed_starts = 0
        self._started_at: float | None = None  # when this guard last started one (monotonic)
        self._quick_deaths = 0  # deaths in a row, each within STABLE_S of its start
        self.stopping = False
        self.task: asyncio.Task[None] | None = None
        self._wrap_stop()

    def _wrap_stop(self) -> None:
        """A stop the manager asks for (its shutdown, Serve's) is not a death: mark it before
        the process is killed, so the guard never starts what is being stopped."""
        original = self.api.stop

        async def stop() -> None:
            self.stopping = True
            await original()

        self.api.stop = stop

    async def run(self) -> None:
        try:
            await self.manager._haproxy_start_task  # Ray's first start
        except Exception:  # noqa: BLE001 - Ray's own path handles a manager that never started
            log.warning("pdserve: HAProxy's first start failed; the guard leaves the manager to Serve")
            return
        while not self.stopping:
            proc = self.api._proc
            if proc is None:  # stopped
                return
            if proc.returncode is None:
                await asyncio.sleep(self.poll_s)
                continue
            wait = self._wait_before_restart()
            if wait:
                log.warning("pdserve: HAProxy (pid %d) died %d time(s) in a row soon after its start; starting it "
                            "again in %.1f s", proc.pid, self._quick_deaths, wait)
                await asyncio.sleep(wait)
            if not await self._restart_if_dead(proc):
                await asyncio.sleep(self.backoff_s)

    def _wait_before_restart(self) -> float:
        """Seconds to wait before starting HAProxy again: none when the one that died ran STABLE_S
        (or was Ray's own start), else BACKOFF_S doubled per such death in a row, MAX_BACKOFF_S at most."""
        if self._started_at is None or time.monotonic() - self._started_at >= STABLE_S:
            self._quick_deaths = 0
            return 0.0
        self._quick_deaths += 1
        return float(min(MAX_BACKOFF_S, self.backoff_s * 2 ** (self._quick_deaths - 1)))

    async def _restart_if_dead(self, proc: Any) -> bool:
        """Start HAProxy again if `proc` is still the manager's process; False when a start failed."""
        async with self.manager._reload_lock:  # a reload replaces _proc under it; the old one then exits
            if self.stopping or self.api._proc is not proc:
                return True
            log.warning("pdserve: HAProxy (pid %d) exited with %s; starting it again", proc.pid, proc.returncode)
            try:
                await self.api.start()
            except Exception:  # noqa: BLE001 - tried again after the backoff; Ray replaces a manager that keeps failing
                self.failed_starts += 1
                log.exception("pdserve: HAProxy did not start again (attempt %d)", self.failed_starts)
                return False
            self.restarts += 1
            self._started_at = time.monotonic()
            log.warning("pdserve: HAProxy started again (pid %d)", self.api._proc.pid)
            return True


def install_guard(manager: Any) -> tuple[bool, int]:
    """Runs in the HAProxy manager actor (`__ray_call__`): start its guard on the manager's
    event loop unless it has one. Returns (installed now, HAProxy restarts so far)."""
    guard = getattr(manager, GUARD_ATTR, None)
    if guard is not None:
        return False, guard.restarts
    guard = HAProxyGuard(manager)
    setattr(manager, GUARD_ATTR, guard)
    loop = manager.event_loop

    def start() -> None:
        guard.task = loop.create_task(guard.run())

    loop.call_soon_threadsafe(start)
    return True, 0
