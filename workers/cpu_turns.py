"""Workers that share a CPU node's cores take turns at them, each using all of them in its turn.

Why: a prefill and a decode worker on one small CPU node each got half the cores. A decode
step is bound by streaming the weights, which one core does at well under the node's
bandwidth, and the decode worker idles no less while the prefill worker has no prompt: the
default 1 prefill + 1 decode on two cores served at 0.65x of one engine on both
(docs/performance.md). Giving both workers every core instead made them fight: each
model's OpenMP threads wait at barriers for a core the other process holds. Taking turns
keeps the disaggregated shape (separate engines, KV handed over, each pool scaled and
restarted on its own) while each forward runs alone on all the cores, as one colocated
engine's does. Measured on 2 cores beside vLLM: 0.85x in turns, 0.82x split (once the
decode step itself got faster), in separate sittings: no clear gain, so it is opt-in
(`--cpu-sharing turns`; docs/performance.md); lending (workers/cpu_lending.py), the
default, gained more.

How: an exclusive `flock` on a file that the workers of one serving app on one node share,
held for each engine step's model work. The kernel drops a dead holder's lock, so a killed
worker never wedges the others. Fairness: a worker that wants the turn holds a shared lock
on a second file while it waits; a holder that finishes a step and sees a waiter gives it
the turn (waits, bounded, until the waiter has taken it) before taking another; a waiter
that did not take it in time (stopped) is not waited for again until no one waits. Every wait
has a deadline: past it the step runs without the turn (logged), which is the old sharing
at worst, and so do the steps after it until the turn is free again (a stopped neighbour
delays one step, not each).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from types import TracebackType

log = logging.getLogger(__name__)

# How long a step waits for the turn before it runs without it. Short: past it the cost is two
# steps sharing the cores (split, at worst), while the engine thread that waits answers none of
# the gateway's polls and computes nothing: at 30 s, a neighbour stopped in its turn had the stall
# watch (cluster/stall_watch.py, 10 s) restart this healthy worker too. As lending's.
ACQUIRE_DEADLINE_S = 2.0
HANDOFF_DEADLINE_S = 0.05  # how long a holder waits for a waiter to take the turn it gave
POLL_S = (0.0001, 0.001)  # first and longest sleep between tries
CGROUP_DIR = "/sys/fs/cgroup"  # a container's own cgroup (its namespace's root), where Ray reads its quota


class CpuTurns:
    """A context manager: `with turns:` around a step's model work. Not thread-safe (one engine
    thread uses it); `stats()` may be read from any thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._turn = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._want = os.open(path + ".want", os.O_RDWR | os.O_CREAT, 0o600)
        self._held = False
        self._stuck = False  # the last step went without the turn: its holder is taken for stuck
        self._waiter_stuck = False  # the last handoff was not taken: its waiter is taken for stuck
        self.turns = 0
        self.waited_s = 0.0  # time spent waiting for the turn, over all turns
        self.given = 0  # turns handed to a waiting worker
        self.missed = 0  # steps run without the turn (deadline passed)

    def __enter__(self) -> CpuTurns:
        start = time.perf_counter()
        if not _try(self._turn, fcntl.LOCK_EX):
            # Tell the holder someone waits (a holder keeps `want` exclusive only while it hands over).
            wants = _poll(self._want, fcntl.LOCK_SH, start + HANDOFF_DEADLINE_S)
            # After one wait past the deadline the holder is taken for stuck (a stopped process
            # keeps its lock until it dies): later steps only try, until the turn is free again.
            # Waiting out the deadline at each step made one token per deadline of every stream.
            deadline = start if self._stuck else start + ACQUIRE_DEADLINE_S
            try:
                self._held = _poll(self._turn, fcntl.LOCK_EX, deadline)
            finally:
                if wants:
                    fcntl.flock(self._want, fcntl.LOCK_UN)
            if not self._held:
                self.missed += 1
                if not self._stuck:
                    log.warning("no CPU turn within %.0f s (%s): running steps without it until it is free",
                                ACQUIRE_DEADLINE_S, self.path)
        else:
            self._held = True
        self._stuck = not self._held
        self.waited_s += time.perf_counter() - start
        self.turns += 1
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._held:
            return
        fcntl.flock(self._turn, fcntl.LOCK_UN)
        self._held = False
        if _try(self._want, fcntl.LOCK_EX):  # nobody waits
            self._waiter_stuck = False
        elif not self._waiter_stuck:  # a worker is waiting: let it in before our next step
            self.given += 1
            # A handoff not taken within its deadline: the waiter is taken for stuck (a stopped
            # process keeps `want` until it dies); later steps only try, until `want` is free.
            # Waiting for it after each step made every step of this worker 50 ms longer.
            self._waiter_stuck = not _poll(self._want, fcntl.LOCK_EX, time.perf_counter() + HANDOFF_DEADLINE_S)
        fcntl.flock(self._want, fcntl.LOCK_UN)

    def stats(self) -> dict[str, float]:
        return {"turns": self.turns, "waited_s": self.waited_s, "given": self.given, "missed": self.missed}

    def close(self) -> None:
        for fd in (self._turn, self._want):
            try:
                os.close(fd)  # closing drops any lock this process holds on it
            except OSError:
                pass


def _try(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _poll(fd: int, kind: int, deadline: float) -> bool:
    """Take the lock, trying with growing sleeps until `deadline`; whether it was taken."""
    sleep = POLL_S[0]
    while not _try(fd, kind):
        if time.perf_counter() >= deadline:
            return False
        time.sleep(sleep)
        sleep = min(POLL_S[1], sleep * 2)
    return True


def turns_path(app: str, directory: str | None = None) -> str:
    """The lock file the workers of serving app `app` share on this node."""
    return os.path.join(directory or _runtime_dir(), f"pdserve-cpu-turns-{_safe_name(app)}.lock")


def lending_dir(app: str, directory: str | None = None) -> str:
    """The directory the workers of serving app `app` share on this node to lend cores
    (workers/cpu_lending.py; here, beside `turns_path`, so that the driver naming it imports no torch)."""
    return os.path.join(directory or _runtime_dir(), f"pdserve-cpu-lending-{_safe_name(app)}")


def remove_node_files(app: str, directory: str | None = None) -> None:
    """Remove serving app `app`'s turns lock file and lending directory on this node, once
    its workers here have stopped (each run on a port of its own left them in /dev/shm).
    Never follows a link."""
    turns = turns_path(app, directory)
    with contextlib.suppress(FileNotFoundError):
        if not os.path.islink(turns) and os.path.isfile(turns):
            os.unlink(turns)
    lending = lending_dir(app, directory)
    if os.path.isdir(lending) and not os.path.islink(lending):
        shutil.rmtree(lending, ignore_errors=True)


def _safe_name(app: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in app) or "app"


def node_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by its container's CPU quota
    in whole CPUs (`docker run --cpus`, a Kubernetes CPU limit), as Ray counts the node's CPUs
    that the workers' shares come from. The affinity alone lists every core of the host there:
    threads beyond the quota only get the engine throttled by the kernel."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_cpu_quota(CGROUP_DIR)
    return cores if quota is None else max(1, min(cores, int(quota)))


def _cgroup_cpu_quota(root: str) -> float | None:
    """CPUs' worth of time per period that this container may use, from cgroup v1's
    `cpu.cfs_quota_us` and `cpu.cfs_period_us` or else v2's `cpu.max` (Ray's order); None where
    there is no quota or it cannot be read."""
    v1 = (os.path.join(root, "cpu", "cpu.cfs_quota_us"), os.path.join(root, "cpu", "cpu.cfs_period_us"))
    try:
        if all(os.path.exists(p) for p in v1):
            quota, period = (_read(p) for p in v1)
        else:
            quota, period = _read(os.path.join(root, "cpu.max")).split()  # "max 100000": none
        q, p = float(quota), float(period)
    except (OSError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _runtime_dir() -> str:
    for d in ("/dev/shm", os.environ.get("TMPDIR", "/tmp")):
        if os.path.isdir(d) and os.access(d, os.W_OK):
            return d
    return "/tmp"


__all__ = ["CpuTurns", "node_cores", "turns_path"]
