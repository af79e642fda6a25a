"""The gateway's planner loop: every `interval_s`, re-plan the prefill:decode split on
the traffic the gateway saw in the last window, export the decision, and (with
`--autoscale-roles`) move one worker toward it.

The loop reads the gateway's own histograms (traffic.py), so it sees what
Prometheus sees. A window with fewer than `min_requests` finished requests says
too little to act on and is skipped. The simulation runs in a thread: it takes
tens to hundreds of milliseconds, which the event loop that streams tokens must
not wait for. One move per window at most, and none while the last one is
still under way: the next window, from the move's end, measures the new split before another.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from pdserve.cluster.bench.metrics import SLO
from pdserve.cluster.metrics import PlannerMetrics
from pdserve.cluster.planner.profile import Profile
from pdserve.cluster.planner.role_planner import DEFAULT_MARGIN, Recommendation, Split, recommend
from pdserve.cluster.planner.simulator import engine_settings
from pdserve.cluster.planner.traffic import TrafficReader
from pdserve.cluster.router.policy import WorkerRole

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannerSettings:
    profile: Profile
    slo: SLO
    interval_s: float = 60.0
    min_requests: int = 20
    margin: float = DEFAULT_MARGIN
    apply: bool = False  # --autoscale-roles: switch roles, not only recommend
    dispatch_s: float = 0.0
    # The share of the tier's traffic this gateway sees is 1 / `replicas` (HAProxy spreads
    # connections evenly over the replicas; the planner runs in one of them): its window's
    # rate is scaled back up by this many.
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {self.replicas}")
        if not self.interval_s > 0:
            raise ValueError(f"planner_interval_s: must be > 0, got {self.interval_s}")
        if self.min_requests < 1:
            raise ValueError(f"planner_min_requests: must be >= 1, got {self.min_requests}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"planner margin: must be in [0, 1), got {self.margin}")


# (from, to) -> the switch's awaitable; the gateway picks which worker of `from` moves.
Move = Callable[[WorkerRole, WorkerRole], Awaitable[object]]


class RolePlannerLoop:
    def __init__(self, settings: PlannerSettings, registry: CollectorRegistry, split: Callable[[], Split | None],
                 move: Move | None = None, clock: Callable[[], float] = time.monotonic,
                 metrics: PlannerMetrics | None = None) -> None:
        self.settings = settings
        self.costs = settings.profile.costs()
        self.engine = engine_settings(settings.profile)
        self.reader = TrafficReader(registry)
        self.metrics = metrics if metrics is not None else PlannerMetrics(registry)
        self.split = split  # the pools' sizes now (None: a pool is empty or changing)
        self.move = move
        self.clock = clock
        self.last: Recommendation | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self.reader.take(self.clock())  # the baseline: the first window starts now
            self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - one bad window must not end planning for good
                log.exception("planner: a window failed")
                self.metrics.decisions.labels("failed").inc()

    async def tick(self) -> Recommendation | None:
        """One window: plan, export, and move a worker when asked to. The recommendation, or
        None when the window was skipped (too few requests, or pools in flux)."""
        window = self.reader.take(self.clock())
        if window is not None and self.settings.replicas > 1:
            window = dataclasses.replace(window, seconds=window.seconds / self.settings.replicas)
        current = self.split()
        if window is None or current is None or window.requests < self.settings.min_requests:
            self.metrics.decisions.labels("skipped").inc()
            return None
        s = self.settings
        rec = await asyncio.to_thread(recommend, self.costs, self.engine, window, current, s.slo, s.margin,
                                      dispatch_s=s.dispatch_s)
        self.last = rec
        self.metrics.record(rec.best.prefill, rec.best.decode, rec.predicted[rec.current], rec.predicted[rec.best],
                            rec.observed_attainment)
        log.info("%s", rec.describe())
        if rec.move is None:
            self.metrics.decisions.labels("keep").inc()
            return rec
        if not s.apply or self.move is None:
            self.metrics.decisions.labels("recommend").inc()
            return rec
        try:
            await self.move(*rec.move)
        except Exception as e:  # noqa: BLE001 - the cluster keeps serving on the old split
            log.warning("planner: moving a worker %s -> %s failed: %s", rec.move[0].value, rec.move[1].value, e)
            self.metrics.decisions.labels("failed").inc()
        else:
            self.metrics.decisions.labels("applied").inc()
        finally:
            # The next window starts now: what finished during the move (its drain, the requests
            # it moved on) is the switch's, on neither split, and must not be taken for the new one's.
            self.reader.take(self.clock())
        return rec
