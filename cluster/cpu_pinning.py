"""Decode workers on CPU cores of their own, on the node that local Ray started.

Why: on a small CPU node every process of the server (the prefill worker, the gateway,
HAProxy, Ray's daemons) and the client share the cores with the decode worker, and each
of them preempts a decode step: its tokens wait in the run queue. A decode step is the
time between two tokens of every running request; a prefill is one request's first
token. Measured on the 2-core test machine (`python bench/cpu_layouts.py`: tiny model, 1P+1D,
vLLM's bench client at concurrency 16, layouts alternating, three rounds; 08:10 UTC
2026-11-28): every process on every core 1054, 885, 940 tok/s (TPOT p50 14.2 ms); decode
alone on core 1 1353, 1009, 1229 (10.2 ms); decode on core 1 and prefill on core 0 with the
serving plane anywhere 1318, 957, 1078; both engines on core 1, the rest on core 0 988, 923,
1215. Decode alone was the fastest in each round (docs/performance.md).

What: each worker that decodes (a decode worker, or a colocated one, which prefills and
decodes in the same steps) and whose engine has a fixed share of threads (split sharing:
not lending cores or taking turns at them, which need every core) gets that many cores,
from the top of the node's CPU list; every other process this one started (the prefill
workers, the gateway, HAProxy, Ray's daemons) and this process get the cores below. A
colocated pool of a small model leaves them one core (cluster/placement.py
`COLOCATED_PLANE_CORES`): vLLM's layout, one engine on its core and the API server on the
other. It needs at least one core left for them, and it is redone every `REFRESH_S` seconds: a
worker Ray restarted (it starts on the rest's cores, which its parent has), or one that
changed role, gets its cores then. vLLM's CPU backend binds its engine the same way (its
log on 2 cores: `core ids=[0]`, `reserved_cpus=[1]`).

Only local Ray (every worker on this node, all started by this process); never a process
this one did not start. CPU affinity needs no privilege for one's own processes.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.cluster.background_priority import descendants

REFRESH_S = 15.0


class CpuPinning(str, enum.Enum):
    AUTO = "auto"  # decode workers with a fixed share of threads on cores of their own (the default)
    OFF = "off"  # every process on every core, as the OS schedules them


@dataclass(frozen=True)
class Pins:
    decode: Mapping[int, frozenset[int]]  # a decoding worker's pid -> its cores
    rest: frozenset[int]  # every other process's cores


def plan(cores: Iterable[int], decode: Sequence[tuple[int, int]]) -> Pins | None:
    """`decode`: (pid, torch threads) of each decode worker to pin. Each gets as many cores as
    threads, from the top of `cores`; the rest get the cores below. None when nothing is to be
    pinned, or when that would leave the rest no core."""
    ordered = sorted(set(cores))
    need = sum(threads for _, threads in decode)
    if not decode or any(threads < 1 for _, threads in decode) or need >= len(ordered):
        return None
    pins: dict[int, frozenset[int]] = {}
    top = len(ordered)
    for pid, threads in decode:
        pins[pid] = frozenset(ordered[top - threads:top])
        top -= threads
    return Pins(pins, frozenset(ordered[:top]))


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
    """Every decode worker, and the processes it started (a tensor-parallel worker's other ranks:
    workers/tp_group.py), onto its cores; `root` (this process) and every other process below it
    onto the rest's. Returns how many processes were set."""
    root = os.getpid() if root is None else root
    where = {pid: cores for worker, cores in pins.decode.items() for pid in (worker, *descendants(worker, proc))}
    return sum(set_affinity(pid, where.get(pid, pins.rest), proc) for pid in [root, *descendants(root, proc)])


def node_cores() -> frozenset[int]:
    """The cores this process may run on (a container's cpuset, not the machine's count)."""
    return frozenset(os.sched_getaffinity(0))


__all__ = ["REFRESH_S", "CpuPinning", "Pins", "apply", "node_cores", "plan", "set_affinity"]
