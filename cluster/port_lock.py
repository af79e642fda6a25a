"""One local run per HTTP port, from its first check to its stop.

Two `pdserve serve --port P` started together both found the port free (the check in
cluster/leftovers.py runs before anything binds), both started a local Ray, and the
second's HAProxy then failed to bind, again and again, while its gateway reported itself
up. The first thing a local run does now is take an exclusive `flock` on a file named
after its port; a second run on that port fails at once with a PortInUseError naming the
holder's pid. The kernel drops the lock of a process that dies (SIGKILL included), so a
crashed run never blocks the next.

One holder is waited for: a run whose `pdserve serve` process was killed outright. The lock,
taken before the fork, is its driver's too, and the driver stops cleanly on its parent's
death (cluster/shutdown.py: 28 s at most), holding it. A start that finds the lock held by
a process that is gone waits for that stop (ORPHAN_STOP_WAIT_S), then clears what the old
run left as any start does; a live holder is still refused at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
import time

from pdserve.cluster.leftovers import PortInUseError

_HELD: dict[str, PortLock] = {}  # lock file -> the lock this process holds on it
# How long a start waits for the driver of a run whose own process is gone to finish its stop
# (its deadline, cluster/shutdown.py's, and a margin).
ORPHAN_STOP_WAIT_S = 35.0
_POLL_S = 0.1


class PortLock:
    """An exclusive lock on `path`, taken without waiting (BlockingIOError when held)."""

    def __init__(self, path: str) -> None:
        self.path = path
        for _ in range(10):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BaseException:
                os.close(fd)
                raise
            # Locked; but a holder that stopped may have removed the file between our open and
            # our lock (`release`): then this is a lock on a name no one else will open. Again.
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd: int | None = fd
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                return
            os.close(fd)
        raise PortInUseError(f"{path}: replaced under this process ten times over while it took the lock")

    def release(self) -> None:
        """Remove the file, then let go (in that order: see the retry above). A file that is not
        this lock's any more is left: a fork holding the same lock (`pdserve serve`'s driver)
        removed it at its stop, and the next run has made it again and holds it."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            if _same_file(os.stat(self.path, follow_symlinks=False), os.fstat(self._fd)):
                os.unlink(self.path)
        os.close(self._fd)
        self._fd = None


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def lock_path(port: int, directory: str | None = None) -> str:
    return os.path.join(directory or tempfile.gettempdir(), f"pdserve-port-{port}.lock")


def hold(port: int, flag: str = "--port", directory: str | None = None) -> None:
    """Take this machine's lock for a local run on `port` (kept until `release`, or this
    process's end); PortInUseError naming the holder when another run has it."""
    path = lock_path(port, directory)
    if path in _HELD:
        return
    try:
        _HELD[path] = _take(path)
    except BlockingIOError:
        raise PortInUseError(f"port {port}: another pdserve run (pid {_holder(path)}) is starting or serving "
                             f"on it; stop that run, or move this one with {flag}") from None
    except OSError as e:  # another user's file, or a link, in its place
        raise PortInUseError(f"port {port}: cannot take the run's lock {path} ({e.strerror}); remove that "
                             f"file, or move the port with {flag}") from None


def _take(path: str) -> PortLock:
    """The lock on `path`; BlockingIOError while a live run holds it. Held for a run whose own
    process is gone (killed: its driver is stopping), it is waited for, ORPHAN_STOP_WAIT_S at most.
    Refused at once, a start right after a SIGKILL failed although the old run was on its way out."""
    deadline: float | None = None
    while True:
        try:
            return PortLock(path)
        except BlockingIOError:
            if _alive(_holder(path)):
                raise
            if deadline is None:
                deadline = time.monotonic() + ORPHAN_STOP_WAIT_S
                print(f"[pdserve] {path}: the run that held it (pid {_holder(path)}) is gone and its processes "
                      f"are stopping; waiting up to {ORPHAN_STOP_WAIT_S:g} s for them", file=sys.stderr, flush=True)
            elif time.monotonic() > deadline:
                raise
            time.sleep(_POLL_S)


def _alive(pid_text: str) -> bool:
    """Whether the process a lock file names runs (unknown, or another user's: taken as alive)."""
    try:
        pid = int(pid_text)
    except ValueError:
        return True
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def release(port: int, directory: str | None = None) -> None:
    lock = _HELD.pop(lock_path(port, directory), None)
    if lock is not None:
        lock.release()


def _holder(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"
