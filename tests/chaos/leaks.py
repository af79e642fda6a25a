"""What a chaos scenario checks after its drain: what the workers still hold above
their baselines (`Leaks`, from two `Snapshot`s of every worker's drain state and
threads), and how the cluster's fault counters grew."""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.cluster.reports import DrainState


@dataclass(frozen=True)
class Leaks:
    """What the workers still held after the drain (summed over workers); tasks and
    threads are counted above each worker's baseline (measured before the fault)."""

    requests: int = 0  # AsyncEngine jobs + engine requests
    blocks: int = 0
    registrations: int = 0
    tasks: int = 0
    threads: int = 0
    unanswered: int = 0  # workers that did not answer drain_state

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def __str__(self) -> str:
        return ", ".join(f"{v} {k}" for k, v in dataclasses.asdict(self).items() if v) or "nothing"

    def short(self) -> str:
        extra = (f" +{self.requests} req" if self.requests else "") + \
            (f" {self.unanswered} silent" if self.unanswered else "")
        return f"{self.blocks}/{self.registrations}/{self.tasks}/{self.threads}{extra}"



def counter_increase(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How much each counter grew (a counter that went down restarted from 0 with its
    process: its value now is what it counted since)."""
    out = {}
    for name, value in after.items():
        grew = value - before.get(name, 0.0)
        out[name] = grew if grew >= 0 else value
    return out


# Threads made on demand up to a fixed number (not leaks): a decode worker's KV waits
# (DecodeWorker._waits, 4 at most), an event loop's default executor, pyzmq's one
# garbage-collector thread (started by the first zero-copy send over 64 KiB).
BOUNDED_POOLS = re.compile(r"^(kv-wait_\d+|asyncio_\d+|ThreadPoolExecutor-\d+_\d+) \[|\[GarbageCollectorThread\]$")


@dataclass(frozen=True)
class Snapshot:
    """Every worker's drain state and thread names (None: it did not answer)."""

    states: dict[str, DrainState | None]
    threads: dict[str, list[str] | None]


def _thread_kinds(names: Iterable[str]) -> collections.Counter[str]:
    """Thread names with their addresses' ports masked (a restarted peer listens on
    another port), bounded pools left out."""
    return collections.Counter(re.sub(r"tcp://\S+", "tcp://*", n) for n in names if not BOUNDED_POOLS.search(n))


def extra_threads(before: list[str] | None, after: list[str] | None) -> list[str]:
    """Threads in `after` beyond those in `before`, by kind (see _thread_kinds)."""
    if before is None or after is None:
        return []
    return sorted((_thread_kinds(after) - _thread_kinds(before)).elements())


def leaks(before: Snapshot, after: Snapshot) -> Leaks:
    """What the workers hold in `after` (tasks and threads: beyond `before`; threads by
    name where the workers told them, by count otherwise)."""
    requests = blocks = regs = tasks = threads = silent = 0
    for name, s in after.states.items():
        if s is None:
            silent += 1
            continue
        b = before.states.get(name)
        requests += s.jobs + s.engine_requests
        blocks += s.used_blocks
        regs += s.kv_registrations
        if b is not None:
            tasks += max(0, s.tasks - b.tasks)
            names_before, names_after = before.threads.get(name), after.threads.get(name)
            if names_before is not None and names_after is not None:
                threads += len(extra_threads(names_before, names_after))
            else:
                threads += max(0, s.threads - b.threads)
    return Leaks(requests, blocks, regs, tasks, threads, silent)


def leak_details(before: Snapshot, after: Snapshot) -> list[str]:
    out = []
    for name, s in after.states.items():
        b = before.states.get(name)
        extra = extra_threads(before.threads.get(name), after.threads.get(name))
        out.append(f"{name}: {s}" + (f" (was {b.tasks} tasks, {b.threads} threads)" if s and b else "")
                   + (f"; threads beyond the baseline: {extra}" if extra else ""))
    return out
