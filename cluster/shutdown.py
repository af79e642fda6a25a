"""How `pdserve serve` stops: SIGTERM or SIGINT, to its process or to its process
group (what systemd, Kubernetes and a terminal's Ctrl-C send), drains Serve,
stops the workers, local Ray and the HAProxy ingress, logs one line and exits 0.

Why two processes. Every process local Ray starts (the GCS, the raylet, its
helpers, and through them the workers and HAProxy) would sit in the process
group of the process that called ray.init, so a signal to that group reached
them all at once: the GCS and the raylet died under the driver, and the
driver's own SIGTERM went to the handler Ray's core worker installs (a stack
trace, then the process ends on the signal or an abort: exit 134). So `pdserve
serve` forks before anything starts. The parent keeps the pid and the group the
caller knows, and only waits; the child, the driver, starts a session of its
own (setsid) and runs Ray, Serve and the workers there, out of reach of a
signal to the caller's group. The parent turns a stop into one SIGINT to the
driver: Python's KeyboardInterrupt, which `serve_app.run` answers by stopping
Serve (its replicas drain) and the workers, and which Ray's handlers leave
alone. The driver then stops local Ray. The parent bounds the whole stop
(`STOP_DEADLINE_S`), then stops by pid whatever is left in the driver's session
(a process there is ours: the session was made for this run), and logs the one
line.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.cluster.serve_config import ServeConfig

# A stop's bound, from the signal to the last process gone: Serve gives a replica 20 s to
# drain by default, Ray's shutdown takes a few more; Kubernetes' default grace period is 30 s.
STOP_DEADLINE_S = 28.0
# What is still in the driver's session once it has exited gets this long after SIGTERM.
SWEEP_GRACE_S = 3.0
_STOPS = {signal.SIGTERM, signal.SIGINT}
_WAITED = {*_STOPS, signal.SIGCHLD}
_PR_SET_PDEATHSIG = 1


def serve_in_own_session(serve: Callable[[], int]) -> int:
    """Run `serve` (which starts Ray and serves until a KeyboardInterrupt) in a child
    process with a session of its own, and return the exit code for `pdserve serve`:
    0 after a stop by SIGTERM or SIGINT that ended within the deadline."""
    sys.stdout.flush()
    sys.stderr.flush()
    # Blocked from before the fork: a signal that comes before the parent waits is still seen.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        os.setsid()
        _stop_when_parent_dies(parent)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)  # Ray's processes inherit the mask
        return serve()
    try:
        return _supervise(child)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _stop_when_parent_dies(parent: int) -> None:
    """A parent killed outright (SIGKILL) still stops the driver cleanly (Linux's
    parent-death signal), instead of leaving Ray running in a session nobody holds."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGINT, 0, 0, 0)
    if os.getppid() != parent:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGINT)


def _supervise(child: int) -> int:
    """Wait for the driver; pass a stop on to it, once; bound the stop; sweep its session."""
    stop: signal.Signals | None = None
    started = deadline = 0.0
    status: int | None = None
    while status is None:
        # No timer while it serves (the parent costs nothing); a deadline once it stops.
        info = (signal.sigwaitinfo(_WAITED) if stop is None
                else signal.sigtimedwait(_WAITED, max(0.0, deadline - time.monotonic())))
        if info is not None and info.si_signo in _STOPS and stop is None:
            stop, started = signal.Signals(info.si_signo), time.monotonic()
            deadline = started + STOP_DEADLINE_S
            os.kill(child, signal.SIGINT)
        status = _exit_status(child)
        if status is None and stop is not None and time.monotonic() >= deadline:
            killed = _sweep(child, grace_s=0.0) + _kill_and_reap(child)
            print(f"[pdserve] stop on {stop.name} took over {STOP_DEADLINE_S:g} s: killed {killed} process(es) "
                  "still running", file=sys.stderr, flush=True)
            return 1
    left = _sweep(child, SWEEP_GRACE_S)
    if stop is not None:
        tail = "" if not left else f"; {left} process(es) left in its session stopped by pid"
        print(f"[pdserve] stopped on {stop.name}: drained, workers, Ray and the ingress shut down in "
              f"{time.monotonic() - started:.1f} s{tail}", file=sys.stderr, flush=True)
    return status


def _exit_status(child: int) -> int | None:
    """The driver's exit code as a shell reports it (128 + N for a signal), or None while it runs."""
    pid, status = os.waitpid(child, os.WNOHANG)
    if pid == 0:
        return None
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _kill_and_reap(child: int) -> int:
    try:
        os.kill(child, signal.SIGKILL)
    except ProcessLookupError:
        return 0
    os.waitpid(child, 0)
    return 1


def _stat(pid: int) -> tuple[int, int] | None:
    """(session, start time in clock ticks) of a live `pid` from /proc; None when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the name: state, ppid, pgrp, session, ...
    except (OSError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else (int(fields[3]), int(fields[19]))


def session_members(sid: int) -> dict[int, int]:
    """pid -> start time of every live process in session `sid`."""
    members = {}
    for entry in os.listdir("/proc"):
        st = _stat(int(entry)) if entry.isdigit() else None
        if st is not None and st[0] == sid:
            members[int(entry)] = st[1]
    return members


def _sweep(sid: int, grace_s: float) -> int:
    """Stop what is left in the driver's session (an HAProxy Ray's shutdown did not reach):
    SIGTERM, up to `grace_s` to go, then SIGKILL. Returns how many there were."""
    left = session_members(sid)
    for pid, started in left.items():
        _signal(pid, started, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive(left):
        time.sleep(0.05)
    for pid in _alive(left):
        _signal(pid, left[pid], signal.SIGKILL)
    return len(left)


def _alive(procs: dict[int, int]) -> list[int]:
    """Those of `procs` still running: the same pid and the same start time (a pid can be reused)."""
    return [pid for pid, started in procs.items() if (_stat(pid) or (0, -1))[1] == started]


def _signal(pid: int, started: int, sig: signal.Signals) -> None:
    if _alive({pid: started}):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_until_stopped(cfg: ServeConfig) -> int:
    """The driver: serve `cfg` until a SIGINT (from the parent), then stop Serve, the
    workers and local Ray, in that order. Returns 0."""
    import ray

    from pdserve.cluster import serve_app

    try:
        serve_app.run(cfg)  # on a KeyboardInterrupt while serving, it stops Serve and the workers
    except KeyboardInterrupt:  # one while starting: what has started is stopped
        if ray.is_initialized():
            try:
                serve_app.shutdown(cfg)
            except Exception as e:  # noqa: BLE001 - Ray's shutdown below stops what this could not
                print(f"[pdserve] stopping Serve while it started: {e!r}", file=sys.stderr, flush=True)
    ray.shutdown()
    return 0
