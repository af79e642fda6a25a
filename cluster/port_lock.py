"""One local run per HTTP port, from its first check to its stop.

Two `pdserve serve --port P` started together both found the port free (the check in
cluster/leftovers.py runs before anything binds), both started a local Ray, and the
second's HAProxy then failed to bind, again and again, while its gateway reported itself
up. The first thing a local run does now is take an exclusive `flock` on a file named
after its port; a second run on that port fails at once with a PortInUseError naming the
holder's pid. The kernel drops the lock of a process that dies (SIGKILL included), so a
crashed run never blocks the next.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile

from pdserve.cluster.leftovers import PortInUseError

_HELD: dict[str, PortLock] = {}  # lock file -> the lock this process holds on it


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
        _HELD[path] = PortLock(path)
    except BlockingIOError:
        raise PortInUseError(f"port {port}: another pdserve run (pid {_holder(path)}) is starting or serving "
                             f"on it; stop that run, or move this one with {flag}") from None
    except OSError as e:  # another user's file, or a link, in its place
        raise PortInUseError(f"port {port}: cannot take the run's lock {path} ({e.strerror}); remove that "
                             f"file, or move the port with {flag}") from None


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
