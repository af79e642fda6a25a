"""Decode workers on CPU cores of their own, on the node that local Ray started.

Why: on a small CPU node every process of the server (the prefill worker, the gateway,
HAProxy, Ray's daemons) and the client share the cores with the decode worker, and each
of them preempts a decode step: its tokens wait in the run queue. A decode step is the
time between two tokens of every running request; a prefill is one request's first
token. Measured on the 2-core test machine (tiny model, 1P+1D, vLLM's bench client at
concurrency 16, three alternating rounds; docs/serving-profile.md): decode on core 1 and
prefill on core 0 served 1717, 1562, 1589 tok/s against 1263, 1533, 1490 unpinned (TPOT
p50 6.4-8.2 ms against 9.0-10.4, TTFT p50 about the same); with the serving plane also
kept off the decode core, 1657, 1555, 1605 but TTFT p50 146-203 ms against 122-155.

What: each decode worker whose engine has a fixed share of threads (split sharing: not
lending cores or taking turns at them, which need every core) gets that many cores, from
the top of the node's CPU list, and the prefill workers share the cores below: an engine
step, a chain of OpenMP regions, never waits behind the other pool's. The serving plane
(the gateway, HAProxy, Ray) is left on every core: it carries each token and its bursts
are short. It needs at least one core left for the prefill workers, and it is redone
every `REFRESH_S` seconds: a worker Ray restarted (it starts on every core), or one that
changed role, gets its cores then.

Only local Ray (every worker on this node, all started by this process); only workers,
and never a process this one did not start. CPU affinity needs no privilege for one's own processes.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.cluster.background_priority import descendants

log = logging.getLogger(__name__)

REFRESH_S = 15.0


class CpuPinning(str, enum.Enum):
    AUTO = "auto"  # decode workers with a fixed share of threads on cores of their own (the default)
    OFF = "off"  # every process on every core, as the OS schedules them


@dataclass(frozen=True)
class Pins:
    decode: Mapping[int, frozenset[int]]  # a decode worker's pid -> its cores
    rest: frozenset[int]  # the prefill workers' cores
    prefill: frozenset[int] = frozenset()  # their pids

    def cores(self) -> dict[int, frozenset[int]]:
        """Every pinned worker's pid -> its cores."""
        return {**{pid: self.rest for pid in self.prefill}, **self.decode}


def plan(cores: Iterable[int], decode: Sequence[tuple[int, int]], prefill: Iterable[int] = ()) -> Pins | None:
    """`decode`: (pid, torch threads) of each decode worker; `prefill`: the prefill workers'
    pids. Each decode worker gets as many cores as threads, from the top of `cores`; the
    prefill workers share the cores below. None when nothing is to be pinned, or when that
    would leave the prefill workers no core."""
    ordered = sorted(set(cores))
    need = sum(threads for _, threads in decode)
    if not decode or any(threads < 1 for _, threads in decode) or need >= len(ordered):
        return None
    pins: dict[int, frozenset[int]] = {}
    top = len(ordered)
    for pid, threads in decode:
        pins[pid] = frozenset(ordered[top - threads:top])
        top -= threads
    return Pins(pins, frozenset(ordered[:top]), frozenset(prefill))


def set_affinity(pid: int, cores: frozenset[int], proc: Path = Path("/proc")) -> bool:
    """Every thread of `pid` (affinity is per thread on Linux; threads made later inherit
    their creator's) onto `cores`; whether the process was there."""
    try:
        tids = [int(t) for t in os.listdir(proc / str(pid) / "task")]
    except OSError:
        return False  # it ended
    for tid in tids:
        try:
            if os.sched_getaffinity(tid) != cores:
                os.sched_setaffinity(tid, cores)
        except OSError:
            continue  # the thread ended
    return True


def apply(pins: Pins, root: int | None = None, proc: Path = Path("/proc")) -> int:
    """Every worker in `pins` that runs below `root` (this process) onto its cores; no other
    process is touched. Returns how many were set."""
    below = set(descendants(os.getpid() if root is None else root, proc))
    return sum(set_affinity(pid, cores, proc) for pid, cores in pins.cores().items() if pid in below)


def node_cores() -> frozenset[int]:
    """The cores this process may run on (a container's cpuset, not the machine's count)."""
    return frozenset(os.sched_getaffinity(0))


__all__ = ["REFRESH_S", "CpuPinning", "Pins", "apply", "node_cores", "plan", "set_affinity"]
