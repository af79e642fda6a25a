"""A worker's change of role (prefill <-> decode) while it serves, on the worker.

The gateway's backend first stops routing to the worker (cluster/disagg_backend.py:
`switch_role`), then calls `WorkerService.switch_role`, which runs `RoleSwitcher.switch`:

    1. refuse: no new work of the old role from now on (`WorkerDrainingError`, which
       the gateway retries elsewhere; a decode worker whose prefill worker refuses
       computes the prompt itself)
    2. drain: the work in flight finishes, up to `drain_timeout_s`
    3. cut: what is left ends with WorkerDrainingError; the gateway's migration
       resumes each request on another worker from the tokens its client has (its
       stream goes on, greedy output unchanged); every exit hook runs, so the
       request's blocks are freed here and on its peer
    4. free: the old role's parts close (KV links or receiver); on the engine
       thread any request left is aborted, the prefix cache emptied (its REMOVED
       events reach the router; the backend also forgets the worker's cache at
       once), a draft model's KV dropped: no block stays used
    5. build: the new role over the same engine (a decode role binds a new KV
       receiver on the kv_host; it decodes speculatively if the engine was built
       with a speculator: n-gram always, a draft model only where it was born to
       decode; it says so when not: exact either way); its metrics
       carry the new pool label

The model stays loaded and the process lives on. One switch at a time; every
wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from pdserve.cluster.reports import RoleSwitch
from pdserve.cluster.roles import Role, make_role
from pdserve.cluster.router.policy import WorkerRole
from pdserve.cluster.worker_metrics import Pool, WorkerMetrics
from pdserve.workers.async_engine import WorkerDrainingError
from pdserve.workers.engine import LLMEngine

if TYPE_CHECKING:
    from pdserve.cluster.actors import WorkerService

log = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.01
# After the cut: how long the engine thread may take to run the cut requests' exits,
# and their calls to return (their errors reach the gateway, which moves them on).
_CUT_WAIT_S = 5.0
# The engine thread's share of the switch (abort what is left, empty the prefix cache).
_RESET_WAIT_S = 10.0
SWITCHABLE = (WorkerRole.PREFILL, WorkerRole.DECODE)


class RoleSwitcher:
    """The worker's role calls (`call`) and its switches (`switch`), on the actor's event loop."""

    def __init__(self, service: WorkerService) -> None:
        self._svc = service
        self.switching = False
        self.num_switches = 0
        # (role, switching, switches so far), replaced as one: the engine thread reads it
        # for load reports while the event loop switches.
        self.status: tuple[WorkerRole, bool, int] = (service.role.role, False, 0)
        self._active = 0  # role calls under way (prefill, serve, handoff)
        self._cuts = 0  # switches that cut calls under way

    @contextlib.asynccontextmanager
    async def call(self, wants: WorkerRole) -> AsyncIterator[Role]:
        """The role for one call that needs `wants`. WorkerDrainingError when the worker
        holds another role or is changing role; a call that a switch cuts raises
        WorkerDrainingError whatever broke on its way out (bad input and deadlines
        stay what they are)."""
        role = self._svc.role
        if self.switching or role.role is not wants:
            now = "changing role" if self.switching else f"a {role.role.value} worker"
            raise WorkerDrainingError(f"worker {self._svc.name} is {now}, not a {wants.value} worker")
        cuts = self._cuts
        self._active += 1
        try:
            yield role
        except (ValueError, TimeoutError, WorkerDrainingError):
            raise
        except Exception as e:
            if self._cuts != cuts:
                raise WorkerDrainingError(f"worker {self._svc.name}: cut by a role switch ({e!r})") from e
            raise
        finally:
            self._active -= 1

    async def switch(self, to: WorkerRole, drain_timeout_s: float) -> RoleSwitch:
        """Take role `to` (module doc). ValueError for a role a disaggregated worker cannot
        hold, a timeout that is no finite number >= 0, or while a switch is under way. If the
        new role cannot be built, the old one is built again and the error raised."""
        svc = self._svc
        if to not in SWITCHABLE:
            raise ValueError(f"role: a disaggregated worker is prefill or decode, got {to.value}")
        if not (math.isfinite(drain_timeout_s) and drain_timeout_s >= 0):  # inf: a drain that may never end
            raise ValueError(f"drain_timeout_s: must be a finite number >= 0, got {drain_timeout_s}")
        if self.switching:
            raise ValueError(f"worker {svc.name}: a role switch is under way")
        start, old = time.monotonic(), svc.role
        if old.role is to:
            return RoleSwitch(to, to, 0, 0, 0.0, self._speculative(to), svc.incarnation, self.num_switches)
        self.switching = True
        self.status = (old.role, True, self.num_switches)
        svc.async_engine.refuse_new(f"worker {svc.name} is changing role ({old.role.value} -> {to.value})")
        try:
            in_flight = max(self._active, svc.async_engine.num_in_flight)
            migrated = 0
            if not await self._drained(start + drain_timeout_s):
                self._cuts += 1
                cut = WorkerDrainingError(f"worker {svc.name} is changing role: the request moves on")
                migrated = await svc.async_engine.end_all(cut, timeout_s=_CUT_WAIT_S)
                if not await self._drained(time.monotonic() + _CUT_WAIT_S):
                    log.warning("worker %s: %d calls still under way after the cut; switching anyway",
                                svc.name, self._active)
            # Past this point the old role is closing: a cancelled caller must not leave the
            # worker with no role, so the rebuild finishes whatever happens to the call.
            rebuild = asyncio.ensure_future(self._rebuild(old, to))
            try:
                await asyncio.shield(rebuild)
            except asyncio.CancelledError:
                async with asyncio.timeout(_RESET_WAIT_S + _CUT_WAIT_S):
                    await rebuild
                raise
        finally:
            self.switching = False
            self.status = (svc.role.role, False, self.num_switches)
            svc.async_engine.refuse_new(None)
        took = time.monotonic() - start
        log.info("worker %s: %s -> %s in %.2f s (%d drained, %d moved on)", svc.name, old.role.value, to.value,
                 took, max(0, in_flight - migrated), migrated)
        return RoleSwitch(old.role, to, max(0, in_flight - migrated), migrated, took, self._speculative(to),
                          svc.incarnation, self.num_switches)

    async def _drained(self, deadline: float) -> bool:
        """Wait until no call or request is left here, or `deadline`; whether none is."""
        ae = self._svc.async_engine
        while self._active or ae.num_in_flight:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(_DRAIN_POLL_S, left))
        return True

    async def _rebuild(self, old: Role, to: WorkerRole) -> None:
        """Close the old role, free the engine's blocks, take `to`. If any of that fails,
        take a new role of `old`'s kind and raise: `old` may be closed by then (a decode
        role's wait threads shut down, a prefill role's links closed), and a worker left
        holding it would fail every call it takes."""
        svc = self._svc
        metrics = WorkerMetrics(Pool(to.value), svc.name, svc.engine.config.num_speculative_tokens,
                                svc.counts).carry(svc.worker_metrics)
        try:
            await asyncio.to_thread(old.close)  # joins its link threads (each bounded): off the event loop
            used = await svc.async_engine.call(lambda e: self._reset(e, metrics), timeout_s=_RESET_WAIT_S)
            if used:  # a bug: every request here ended, so no block can be referenced
                log.error("worker %s: %d KV blocks still used after its requests ended", svc.name, used)
            svc.worker_metrics = metrics
            role = make_role(to, svc.ctx, metrics)
        except Exception:
            log.exception("worker %s: cannot take the %s role; back to %s", svc.name, to.value, old.role.value)
            await self._take_back(old.role, metrics)
            raise
        svc.role = role
        self.num_switches += 1
        if to is WorkerRole.DECODE and not self._speculative(to) and svc.config.speculative is not None:
            log.warning("worker %s decodes without speculative decoding: its engine was built for prefill, "
                        "without the %s model (outputs are exact either way)", svc.name, svc.config.speculative.value)

    async def _take_back(self, role: WorkerRole, tried: WorkerMetrics) -> None:
        """A new role of kind `role` after a failed switch, with its pool's metrics. The
        engine may be why the switch failed (dead, or stuck past the reset's deadline): then
        its step observers stay as they are, and the worker serves what it can."""
        svc = self._svc
        back = WorkerMetrics(Pool(role.value), svc.name, svc.engine.config.num_speculative_tokens,
                             svc.counts).carry(svc.worker_metrics)
        observed = (svc.worker_metrics, tried)
        try:
            await svc.async_engine.call(lambda e: self._swap_metrics(e, observed, back), timeout_s=_RESET_WAIT_S)
            svc.worker_metrics = back
        except Exception as e:  # noqa: BLE001 - the switch's own error is what the caller gets
            log.warning("worker %s: its step metrics stay as they were (%r)", svc.name, e)
        svc.role = make_role(role, svc.ctx, svc.worker_metrics)  # if this fails too, the caller gets that error

    def _reset(self, e: LLMEngine, metrics: WorkerMetrics) -> int:
        """Engine thread: abort what is left, empty the prefix cache, observe steps with
        `metrics`; the blocks still used (0)."""
        left = list(e.scheduler.requests)
        if left:
            log.warning("worker %s: %d engine requests outlived their jobs; aborting them", self._svc.name, len(left))
            e.abort(left, output=False)
        e.kv.pool.reset_cache()
        if e.spec is not None:
            e.spec.proposer.retain(set())  # a draft model's KV
        self._swap_metrics(e, (self._svc.worker_metrics,), metrics)
        return e.kv.pool.num_used

    @staticmethod
    def _swap_metrics(e: LLMEngine, old: tuple[WorkerMetrics, ...], new: WorkerMetrics) -> None:
        """Engine thread (it reads the observers at every step): `new` observes steps
        instead of any of `old` that did."""
        for m in old:
            with contextlib.suppress(ValueError):
                e.step_observers.remove(m.observe_step)
        new.attach(e)

    def _speculative(self, role: WorkerRole) -> bool:
        return role is WorkerRole.DECODE and self._svc.engine.spec is not None
