"""Hang detection: a worker that holds work and makes no progress for `timeout_s`
is taken for dead by the gateway, which moves its requests and restarts it.

A worker dies loudly (its process exits: Ray fails its calls) or quietly: a
SIGSTOPped process, a step that never returns, an engine thread that no longer
steps. Nothing fails then; the requests on it wait for their deadline. The
gateway already polls every worker's load (`LoadReport`, every
`--load-poll-interval`), and a poll runs on the worker's engine thread between
two steps, so the polls say both things this watch needs:

- **no answer**: the worker has not answered a poll for `timeout_s` while it
  holds work (tries of this gateway's requests on it, or requests in its last
  report). A SIGSTOPped process answers nothing at all.
- **no progress**: it answers, with requests in its running batch, but its
  count of tokens computed (prompt tokens computed + tokens generated, from its
  engine snapshot) has not moved for `timeout_s`.

A worker with no work is never stalled: a model load, a compile at start, a
restart hold no request. A step longer than `timeout_s` with requests in it
does count as a stall: the timeout is a few times the slowest step expected
(`DEFAULT_STALL_TIMEOUT_S`). Time the gateway itself was not looking (its event
loop held up: the watch's ticks came late) is not held against the workers.

Pure and clock-free: the caller passes `now` (tests use a fake clock).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pdserve.cluster.ray_errors import RayActorError
from pdserve.workers.stats import EngineSnapshot

# The default `--stall-timeout`. A worker's steps take milliseconds to a second (a full
# chunk of prefill on a CPU); this is a few times that, and short enough that a stream
# on a stopped worker waits well under 15 s for its next token (docs/reliability.md).
DEFAULT_STALL_TIMEOUT_S = 10.0
# Ticks further apart than this (more than the interval the caller ticks at) mean the
# gateway's loop was held up: the time between them is not counted against any worker.
DEFAULT_MAX_TICK_GAP_S = 1.0


class WorkerStalledError(RayActorError):  # type: ignore[misc]  # Ray is untyped (mypy skips it)
    """The try's worker made no progress for the stall timeout: the gateway took it for
    dead. A RayActorError, as Ray's own "unavailable" and "died" are, so that every path
    that moves a request off a dead worker (cluster/token_streams.py `WORKER_LOST`) moves it."""

    def __init__(self, message: str) -> None:
        super().__init__(error_msg=message)


@dataclass(frozen=True)
class Stall:
    """A worker taken for stalled, and why (for the log)."""

    worker: str
    reason: str


def progress_of(snapshot: EngineSnapshot) -> int:
    """Tokens the engine has computed so far: it moves with every step that ran the model."""
    return snapshot.prompt_tokens_computed + snapshot.generation_tokens


@dataclass
class _Seen:
    answered_at: float  # its last answer (or when the watch started, or gave it up)
    progressed_at: float  # when its progress last moved (or it last had nothing running)
    progress: int = -1  # -1: no report yet
    running: int = 0  # requests in its running batch, at its last report
    waiting: int = 0  # queued ones (and a decode worker's awaiting their KV)


class StallWatch:
    """Per worker: its last answer and its last progress. `answered` on each poll's
    report; `check` every tick returns the workers stalled now, each once (its state
    starts afresh, as for a worker with nothing: a worker being restarted holds no
    work, so it fires again only once it has some and stalls again)."""

    def __init__(self, timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
                 max_tick_gap_s: float = DEFAULT_MAX_TICK_GAP_S) -> None:
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"stall timeout: must be a positive number of seconds, got {timeout_s!r}")
        if not max_tick_gap_s > 0:
            raise ValueError(f"max_tick_gap_s: must be > 0, got {max_tick_gap_s!r}")
        self.timeout_s = timeout_s
        self.max_tick_gap_s = max_tick_gap_s
        self._seen: dict[str, _Seen] = {}
        self._last_tick: float | None = None

    def answered(self, worker: str, now: float, snapshot: EngineSnapshot) -> None:
        """The worker answered a poll with `snapshot` (its engine's, taken between two steps)."""
        s = self._state(worker, now)
        s.answered_at = now
        progress = progress_of(snapshot)
        if progress != s.progress or not snapshot.running:
            s.progressed_at = now  # it moved, or it has nothing it should move
        s.progress, s.running, s.waiting = progress, snapshot.running, snapshot.waiting

    def check(self, now: float, tries: Mapping[str, int], workers: Iterable[str]) -> list[Stall]:
        """The `workers` stalled at `now`; `tries`: this gateway's tries in flight on each."""
        self._skip_pause(now)
        stalls: list[Stall] = []
        for w in workers:
            s = self._state(w, now)
            held = tries.get(w, 0)
            silent = now - s.answered_at
            if (held or s.running or s.waiting) and silent > self.timeout_s:
                stalls.append(Stall(w, f"no answer for {silent:.1f} s, holding {held} tries of this gateway "
                                       f"({s.running} running, {s.waiting} waiting at its last report)"))
            elif s.running and now - s.progressed_at > self.timeout_s:
                stalls.append(Stall(w, f"no token computed for {now - s.progressed_at:.1f} s with "
                                       f"{s.running} requests running"))
            else:
                continue
            self.forget(w, now)
        return stalls

    def forget(self, worker: str, now: float) -> None:
        """Start `worker` afresh: it holds nothing we know of, last heard from `now`
        (given up on, restarted, or back in a pool)."""
        self._seen[worker] = _Seen(now, now)

    def _state(self, worker: str, now: float) -> _Seen:
        s = self._seen.get(worker)
        if s is None:
            s = self._seen[worker] = _Seen(now, now)
        return s

    def _skip_pause(self, now: float) -> None:
        """A tick that comes late (the gateway's loop was held up: nobody read the
        workers' answers meanwhile) moves every worker's clock on by the lateness."""
        last, self._last_tick = self._last_tick, now
        if last is None or now - last <= self.max_tick_gap_s:
            return
        late = now - last
        for s in self._seen.values():
            s.answered_at = min(now, s.answered_at + late)
            s.progressed_at = min(now, s.progressed_at + late)
