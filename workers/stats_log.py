"""A worker's stats line in its log, every 10 s while it works: vLLM's "Avg prompt throughput" line.

Why: whoever runs a server tails its log before anything else; vLLM's engines write their
throughput, batch, queue, KV cache usage and prefix-cache hit rate there every 10 s, and
`--disable-log-stats` turns it off. pdserve's workers do the same (the Prometheus families in
cluster/worker_metrics.py carry the same figures for dashboards).

How: `tick` runs on the engine thread once per loop iteration (an idle engine loop still wakes
every ~0.1 s: workers/async_engine.py), so the snapshot it takes is consistent without a lock.
It logs at most once an interval, while the engine computed something or holds requests, and
once more when it falls idle (a line of zeros says the load ended); an idle engine logs nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.workers.info_log import info_logger
from pdserve.workers.stats import EngineSnapshot

if TYPE_CHECKING:
    from pdserve.workers.engine import LLMEngine

LOGGER = "pdserve.stats"
INTERVAL_S = 10.0  # vLLM's default (VLLM_LOG_STATS_INTERVAL)

log = logging.getLogger(LOGGER)


class StatsLog:
    """`tick(engine)` on the engine thread; `emit` (default: the `pdserve.stats` logger at INFO)
    receives each line."""

    def __init__(self, name: str, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 emit: Callable[[str], None] | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: {interval_s} must be positive")
        self.name, self.interval_s, self._clock = name, interval_s, clock
        if emit is None:
            emit = info_logger(LOGGER).info
        self._emit = emit
        self._last: EngineSnapshot | None = None
        self._last_at = clock()
        self._due = self._last_at + interval_s
        self._was_busy = False
        self._off = False

    def tick(self, engine: LLMEngine) -> None:
        now = self._clock()
        if now < self._due or self._off:
            return
        try:
            self.observe(engine.snapshot(), now)
        except Exception:  # noqa: BLE001 - a log line must never end the engine thread it runs on
            self._off = True
            log.exception("%s: the stats line failed; no more of them", self.name)

    def observe(self, snap: EngineSnapshot, now: float) -> None:
        """Log `snap` against the last one, if the engine worked since (or just stopped)."""
        last = self._last or EngineSnapshot()
        dt = max(now - self._last_at, 1e-9)
        busy = (snap.running > 0 or snap.waiting > 0 or snap.prompt_tokens_computed != last.prompt_tokens_computed
                or snap.generation_tokens != last.generation_tokens)
        if busy or self._was_busy:
            self._emit(self.line(last, snap, dt))
        self._last, self._last_at, self._due, self._was_busy = snap, now, now + self.interval_s, busy

    def line(self, last: EngineSnapshot, snap: EngineSnapshot, dt: float) -> str:
        prompt = (snap.prompt_tokens_computed - last.prompt_tokens_computed) / dt
        generation = (snap.generation_tokens - last.generation_tokens) / dt
        used = 1 - snap.free_blocks / snap.total_blocks if snap.total_blocks else 0.0
        queried = snap.prompt_tokens - last.prompt_tokens
        hits = f"{100 * (snap.prompt_tokens_cached - last.prompt_tokens_cached) / queried:.1f}%" if queried else "n/a"
        text = (f"{self.name}: prompt throughput {prompt:.1f} tokens/s, generation throughput {generation:.1f} "
                f"tokens/s, running {snap.running} reqs, waiting {snap.waiting} reqs, KV cache usage "
                f"{100 * used:.1f}%, prefix cache hit rate {hits}")
        drafted = snap.spec_draft_tokens - last.spec_draft_tokens
        if drafted:
            accepted = snap.spec_accepted_tokens - last.spec_accepted_tokens
            drafts = snap.spec_drafts - last.spec_drafts
            # vLLM's "mean acceptance length": tokens a verify step yields, the bonus token included
            text += (f", draft acceptance rate {100 * accepted / drafted:.1f}%, mean acceptance length "
                     f"{1 + accepted / max(drafts, 1):.2f}")
        if snap.preemptions != last.preemptions:
            text += f", preemptions {snap.preemptions - last.preemptions}"
        return text
