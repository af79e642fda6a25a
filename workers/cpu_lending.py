"""Workers that share a CPU node lend their cores while they have nothing to do.

Why: split (each worker a fixed share of the node's cores) leaves a decode worker on one
core of two while the prefill worker has no prompt, and a decode step is bound by
streaming the weights, which one core does well under the node's bandwidth. Turns
(workers/cpu_turns.py) give every step all the cores but make a prefill wait for every
decode step and the reverse. Lending is split while two workers have work, and all the
cores for a worker whose neighbours are idle: a prefill worker that gets a prompt waits
for at most the one decode step then running, and both then step at their shares.

How, with `flock`s in a directory the workers of one app on one node share (the kernel
drops a dead process's locks, so a killed worker never wedges the others):
- a worker that has work holds an exclusive lock on its own `busy-*` file; a worker
  probes its neighbours' with a non-blocking shared lock (taken: that one is idle);
- a wide step (all the node's cores) holds `wide.lock` exclusively, and is taken only
  when no neighbour is busy (checked after taking the lock); a share step holds it
  shared. A worker that turns busy sets its busy lock first and then waits for the
  shared lock, so either the wide-stepper sees it busy, or it waits for that one step.
The thread count changes per step with `torch.set_num_threads`; the compiled graphs
are specialised per thread count (dynamo guards on it), so the engine compiles both at
start (`thread_counts`). Every wait has a deadline; past it the step runs at its share
without the lock (logged), which is split at worst, and so do the steps after it until
the lock is free again (a stopped neighbour delays one step, not each).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections.abc import Callable
from types import TracebackType

import torch

from pdserve.workers.cpu_turns import _poll, _try, lending_dir

log = logging.getLogger(__name__)

BUSY_DEADLINE_S = 1.0  # neighbours probe our busy lock for microseconds at a time
# How long a step waits for a neighbour's wide step to end before it runs at its share without
# the lock. Short: past it the cost is two steps sharing the cores (split, at worst), while a
# neighbour SIGSTOPped in a wide step keeps its lock until it dies; at 30 s (as turns wait) the
# decode worker that took the stopped one's streams waited with them (a 15.3 s gap in the
# chaos matrix's (j), against issue 46's 15 s bar).
ACQUIRE_DEADLINE_S = 2.0


class CpuLending:
    """A context manager: `with lending:` around a step's model work. `has_work()` says,
    after the step, whether the engine still has requests (else it gives its cores up).
    Not thread-safe (one engine thread uses it); `stats()` may be read from any thread."""

    def __init__(self, directory: str, share: int, wide: int, has_work: Callable[[], bool]) -> None:
        if share < 1 or wide < share:
            raise ValueError(f"cpu lending: need 1 <= share <= wide threads, got share={share}, wide={wide}")
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.directory, self.share, self.wide, self._has_work = directory, share, wide, has_work
        self._wide = os.open(os.path.join(directory, "wide.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        self._name = f"busy-{os.getpid()}-{id(self):x}"
        self._busy = os.open(os.path.join(directory, self._name), os.O_RDWR | os.O_CREAT, 0o600)
        self._neighbours: dict[str, int] = {}  # busy file name -> our fd on it
        self._is_busy = self._held = self._stuck = False
        self._unseen = False  # the directory could not be listed last time (warned once)
        self.steps = 0
        self.wide_steps = 0  # steps run on all the node's cores
        self.waited_s = 0.0  # time spent waiting for a neighbour's wide step to end
        self.missed = 0  # steps run without the lock (deadline passed)

    @property
    def thread_counts(self) -> tuple[int, ...]:
        """The thread counts steps run at: the compiled graphs need each."""
        return tuple(sorted({self.share, self.wide}))

    def __enter__(self) -> CpuLending:
        start = time.perf_counter()
        if not self._is_busy:
            self._is_busy = _poll(self._busy, fcntl.LOCK_EX, start + BUSY_DEADLINE_S)
        threads = self.share
        if self.wide > self.share and _try(self._wide, fcntl.LOCK_EX):
            if self._neighbour_busy():
                fcntl.flock(self._wide, fcntl.LOCK_UN)
            else:
                self._held, threads = True, self.wide
        if not self._held:
            # After one wait past the deadline the holder is taken for stuck (a stopped
            # process keeps its lock): later steps only try, until the lock is free again.
            deadline = start if self._stuck else start + ACQUIRE_DEADLINE_S
            self._held = _poll(self._wide, fcntl.LOCK_SH, deadline)
            if not self._held:
                self.missed += 1
                if not self._stuck:
                    log.warning("a neighbour's wide step lasted over %.0f s (%s): stepping at this worker's "
                                "share without the lock until it is free", ACQUIRE_DEADLINE_S, self.directory)
        self._stuck = not self._held
        self.waited_s += time.perf_counter() - start
        self.steps += 1
        if threads > self.share:
            self.wide_steps += 1
        torch.set_num_threads(threads)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        torch.set_num_threads(self.share)
        if self._held:
            fcntl.flock(self._wide, fcntl.LOCK_UN)
            self._held = False
        self.idle()

    def idle(self) -> None:
        """Stop being busy unless there is work: after each step, and whenever the engine
        finds nothing to step (its last request aborted, or waiting for its KV)."""
        if self._is_busy and not self._has_work():
            fcntl.flock(self._busy, fcntl.LOCK_UN)
            self._is_busy = False

    def _neighbour_busy(self) -> bool:
        """Whether another worker of this app on this node holds its busy lock. Files of
        dead processes (lock free, pid gone) are removed on the way. The directory gone (a
        cleanup of /dev/shm, systemd's RemoveIPC at logout): neighbours unseen count as busy,
        so steps run at the share (split) instead of raising with `wide.lock` held."""
        try:
            listed = os.listdir(self.directory)
        except OSError as e:
            if not self._unseen:
                log.warning("cannot list %s (%s): stepping at this worker's share", self.directory, e.strerror)
            self._unseen = True
            return True
        self._unseen = False
        names = {n for n in listed if n.startswith("busy-") and n != self._name}
        for gone in self._neighbours.keys() - names:
            os.close(self._neighbours.pop(gone))
        busy = False
        for name in sorted(names):
            fd = self._neighbours.get(name)
            if fd is None:
                try:
                    fd = self._neighbours[name] = os.open(os.path.join(self.directory, name), os.O_RDWR)
                except FileNotFoundError:
                    continue
            if not _try(fd, fcntl.LOCK_SH):
                busy = True
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            if not _alive(name):
                _unlink(os.path.join(self.directory, name))
                os.close(self._neighbours.pop(name))
        return busy

    def stats(self) -> dict[str, float]:
        return {"steps": self.steps, "wide_steps": self.wide_steps, "waited_s": self.waited_s,
                "missed": self.missed}

    def close(self) -> None:
        for fd in (self._wide, self._busy, *self._neighbours.values()):
            try:
                os.close(fd)  # closing drops any lock this process holds on it
            except OSError:
                pass
        self._neighbours.clear()
        _unlink(os.path.join(self.directory, self._name))


def _alive(busy_name: str) -> bool:
    try:
        os.kill(int(busy_name.split("-")[1]), 0)
    except (ValueError, IndexError):
        return False
    except OSError as e:
        return e.errno == errno.EPERM  # exists, another user's
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


__all__ = ["CpuLending", "lending_dir"]
