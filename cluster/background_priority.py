"""Ray's and Serve's own processes run behind the engines on the node local Ray started.

Why: Ray starts every worker process (the engines, the gateway replica, haproxy) at nice 15
unless RAY_worker_niceness says otherwise, so on a shared CPU node its own daemons and any
other process (a log shipper, a batch job, a client) took the cores from the engines first.
`pdserve serve` starts local Ray with the workers at 0 (cluster/local_env.py) and puts Ray's
control plane (GCS, log monitor, dashboard and agents, Serve's controller, and Serve's Python
proxy where HAProxy is the ingress) at nice 19 here: they still get every idle moment but no
longer preempt a step (an engine step is a chain of OpenMP fork-join regions: one thread
preempted stalls all of it, so a neighbour costs a two-thread engine more than its own share
of a core). Measured (docs/performance.md): with one busy process at the default priority
beside the server, the tiny model at concurrency 16 served a median 463 tok/s against 248
before (four alternating pairs, wide spread). Nice 19 rather than 10: beside the offline engine
a neighbour taking 14% of a core cost SmolLM2 13% of its speed at nice 0 and nothing at 19, the
tiny model 9% at nice 10 (bench/experiments/neighbour_cost.py); served (SmolLM2, one colocated worker, concurrency 8)
the control plane at 19 instead of 10 took the engine from 0.81x of the offline engine to
0.92x (medians of three alternating rounds, bench/serving_profile.py). The weight of nice 19 (15 against 1024)
still leaves the control plane ~1.5% of each core when the engines keep both busy.

Which: only processes this one started (its descendants: local Ray, never a cluster it
joined) whose command line names one of BACKGROUND. Never a process that starts others
that must not inherit the nice value (nice is inherited at fork): the raylet starts every
worker and actor, HAProxyManager restarts haproxy; never the gateway replica or haproxy,
which carry every token; never an idle pooled worker (`ray::IDLE`), which Ray may turn into
an engine later. Raising nice needs no privilege; it is never lowered here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

# Command-line markers of the processes to put behind the engines (ray::X is an actor's title).
# Serve's Python proxy is HAProxy's fallback, off the requests' path, unless it is the ingress
# itself (`--ingress proxy`): then it carries every token, as the gateway replica does.
PYTHON_PROXY = "ray::ProxyActor"
BACKGROUND = ("/gcs_server", "/log_monitor.py", "/dashboard/dashboard.py", "/autoscaler/_private/monitor.py",
              "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::ServeController", PYTHON_PROXY)
DEFAULT_NICE = 19


def _parents(proc: Path) -> dict[int, int]:
    """{pid: parent pid} of every process now."""
    out: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it ended
        out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and ')'
    return out


def descendants(root: int, proc: Path = Path("/proc")) -> list[int]:
    """Every process below `root` now (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents(proc).items():
        children.setdefault(parent, []).append(pid)
    out: list[int] = []
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def is_background(cmdline: str, proxy_is_ingress: bool = False) -> bool:
    """Whether `cmdline` is one of the control plane's processes; Serve's Python proxy is not when
    it is the HTTP ingress (`proxy_is_ingress`)."""
    if proxy_is_ingress and PYTHON_PROXY in cmdline:
        return False
    return any(marker in cmdline for marker in BACKGROUND)


def renice_threads(pid: int, nice: int, proc: Path = Path("/proc"), only_raise: bool = True) -> int:
    """Every thread of `pid` (nice is per thread on Linux) to `nice`, never lower than it is
    unless `only_raise` is False (an experiment's, bench/serving_profile.py --renice);
    returns how many were set."""
    count = 0
    try:
        tids = [int(t) for t in os.listdir(proc / str(pid) / "task")]
    except OSError:
        return 0  # it ended
    for tid in tids:
        try:
            if not only_raise or os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                count += 1
        except OSError:
            continue  # the thread ended, or it is not ours
    return count


def deprioritize_background(nice: int = DEFAULT_NICE, root: int | None = None, proc: Path = Path("/proc"),
                            proxy_is_ingress: bool = False) -> list[int]:
    """Put the BACKGROUND processes below `root` (this process) at `nice` (Serve's Python proxy
    not when it is the ingress: `proxy_is_ingress`); returns their pids. 0 leaves everything as it is."""
    if nice <= 0:
        return []
    done: list[int] = []
    for pid in descendants(os.getpid() if root is None else root, proc):
        try:
            cmdline = (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if is_background(cmdline, proxy_is_ingress):
            renice_threads(pid, nice, proc)
            done.append(pid)
    log.info("Ray's control plane at nice %d (%d processes)", nice, len(done))
    return done


def nice_of(pids: Iterable[int]) -> dict[int, int]:
    """{pid: its main thread's nice value} (for tests and logs)."""
    out: dict[int, int] = {}
    for pid in pids:
        try:
            out[pid] = os.getpriority(os.PRIO_PROCESS, pid)
        except OSError:
            continue
    return out
