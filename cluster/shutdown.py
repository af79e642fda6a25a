"""How `pdserve serve` stops: SIGTERM or SIGINT, to its process or to its process
group (what a service manager, a container's stop and a terminal's Ctrl-C send),
lets the requests in flight finish, stops Serve, the workers, local Ray and the
HAProxy ingress, logs one line and exits 0.

Why two processes. Every process local Ray starts (the GCS, the raylet, its
helpers, and through them the workers and HAProxy) would sit in the process
group of the process that called ray.init, so a signal to that group reached
them all at once: the GCS and the raylet died under the driver, and the
driver's own SIGTERM went to the handler Ray's core worker installs (a stack
trace, then the process ends on the signal or an abort: exit 134). So `pdserve
serve` forks before anything starts. The parent keeps the pid and the group the
caller knows, and only waits; the child, the driver, moves to a process group
of its own (the session stays the caller's) and runs Ray, Serve and the workers
there, out of reach of a signal to the caller's group. The parent turns a stop
into one SIGINT to the driver (a signal Ray's handlers leave alone), which
waits until the gateway has no request in flight (`DRAIN_S` at most; Serve's
shutdown alone cut streams short), then raises the KeyboardInterrupt that
`serve_app.run` answers by stopping Serve and the workers, and stops local Ray.
The parent bounds the whole stop (`STOP_DEADLINE_S`), stops by pid whatever
the driver left (it is the subreaper of its descendants: what outlives the
driver becomes its child, not init's), and logs the one line. A parent killed
outright (SIGKILL, the OOM killer) sends the driver that SIGINT by its death
(PR_SET_PDEATHSIG); the driver then bounds its own stop and stops what it left.

A service manager that signals every process of the service at once (systemd's
default KillMode=control-group) reaches Ray's processes directly: give
pdserve's unit KillMode=mixed (SIGTERM to the main process, SIGKILL to what is
left after the timeout).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple, NoReturn

if TYPE_CHECKING:
    from pdserve.cluster.serve_config import ServeConfig

# A stop's bound, from the signal to the last process gone: the drain (DRAIN_S), then Serve's and
# Ray's shutdown (7 to 9 s on a 2-core machine under load); Kubernetes' default grace period is 30 s.
STOP_DEADLINE_S = 28.0
# How long the requests in flight at a stop get to finish; what a gateway still holds just before
# then, it ends with an error event (cluster/drain_flag.py `STOP_STREAMS_AFTER_S`).
DRAIN_S = 10.0
SCRAPE_TIMEOUT_S = 5.0  # one read of the gateway's in-flight count (below)
# What the driver left running once it has exited gets this long after SIGTERM.
SWEEP_GRACE_S = 3.0
SWEEP_ROUNDS = 3  # a sweep looks again for what started while it stopped the rest (stop_found)
LATE_GRACE_S = 0.5
_STOPS = {signal.SIGTERM, signal.SIGINT}
_WAITED = {*_STOPS, signal.SIGCHLD}
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def serve_in_own_group(serve: Callable[[], int]) -> int:
    """Run `serve` (which starts Ray and serves until a KeyboardInterrupt) in a child
    process with a process group of its own, and return the exit code for `pdserve
    serve`: 0 after a stop by SIGTERM or SIGINT that ended within the deadline."""
    sys.stdout.flush()
    sys.stderr.flush()
    # Blocked from before the fork: a signal that comes before the parent waits is still seen.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    parent = os.getpid()
    # The caller's own children (a process that calls this in-process, as the tests do, may have
    # some): never reaped, swept or waited for here.
    theirs = frozenset(descendants(parent))
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # not inherited by the child
    child = os.fork()
    if child == 0:
        _run_driver(serve, parent, old_mask)  # never returns: the child must not go back into the caller's code
    try:
        return _supervise(child, theirs)
    finally:
        _prctl(_PR_SET_CHILD_SUBREAPER, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _run_driver(serve: Callable[[], int], parent: int, old_mask: Iterable[int]) -> NoReturn:
    """The child: its own process group, `serve()`, then `os._exit` with its code (a ValueError,
    a bad setting or a port in use, is reported as the CLI reports one: exit 2)."""
    code = 1
    try:
        os.setpgid(0, 0)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGINT)  # a parent killed outright still stops the driver cleanly
        if os.getppid() != parent:  # it died before that took effect
            os.kill(os.getpid(), signal.SIGINT)
        # Ray's processes inherit the mask: the caller's, but never with a stop blocked. The
        # supervisor stops the driver with SIGINT, and a caller that blocked it would leave the
        # driver deaf until the stop's deadline (the test suite's process had, in CI, by then).
        signal.pthread_sigmask(signal.SIG_SETMASK, set(old_mask) - _STOPS)
        # Likewise SIGINT must raise KeyboardInterrupt here: a process started in the background
        # of a non-interactive shell (`pdserve serve &` in a script) inherits it ignored, and
        # Python then installs no handler; the stop would run into its deadline.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Thread(target=_bound_an_orphaned_stop, args=(parent,), name="pdserve-orphan-watch",
                         daemon=True).start()
        code = serve()
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        code = 2
    except BaseException:  # noqa: BLE001 - reported, then the process ends: nothing may unwind into the caller
        traceback.print_exc()
    finally:
        if os.getppid() != parent:  # the supervisor is gone: its sweep is this process's to do
            _sweep_mine(SWEEP_GRACE_S)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _bound_an_orphaned_stop(parent: int) -> None:
    """The driver's thread that stands in for a supervisor killed outright (SIGKILL, the OOM
    killer): its death sends the driver the SIGINT that stops it (PR_SET_PDEATHSIG), but no
    one bounded that stop or stopped what it left. Once the parent is gone (polled once a
    second: a syscall), the stop gets STOP_DEADLINE_S; past it, everything of the driver's
    is killed and the driver exits 1."""
    while os.getppid() == parent:
        time.sleep(1.0)
    time.sleep(STOP_DEADLINE_S)
    print(f"[pdserve] the supervisor died and the stop took over {STOP_DEADLINE_S:g} s: killing what is left",
          file=sys.stderr, flush=True)
    _sweep_mine(0.0)
    os._exit(1)


def _prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _supervise(child: int, theirs: frozenset[int] = frozenset()) -> int:
    """Wait for the driver; pass a stop on to it, once; bound the stop; stop what it left
    (never the caller's own children, `theirs`)."""
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
        status = _reap(child, theirs)
        if status is None and stop is not None and time.monotonic() >= deadline:
            killed = _sweep(0.0, theirs)  # the driver among them
            os.waitpid(child, 0)
            print(f"[pdserve] stop on {stop.name} took over {STOP_DEADLINE_S:g} s: killed {killed} process(es) "
                  "still running", file=sys.stderr, flush=True)
            return 1
    # Within the stop's deadline, not after it: a kubelet's SIGKILL at its 30 s would cut the sweep short.
    grace = SWEEP_GRACE_S if stop is None else min(SWEEP_GRACE_S, max(0.0, deadline - time.monotonic()))
    left = _sweep(grace, theirs)
    if stop is not None:
        took = f"in {time.monotonic() - started:.1f} s"
        tail = "" if not left else f"; {left} process(es) it left stopped by pid"
        print(f"[pdserve] stopped on {stop.name}: drained, workers, Ray and the ingress shut down {took}{tail}"
              if status == 0 else f"[pdserve] stop on {stop.name}: the server exited with {status} {took}{tail}",
              file=sys.stderr, flush=True)
    return status


def _reap(child: int, theirs: frozenset[int] = frozenset()) -> int | None:
    """Reap the driver and every orphan of its tree this process adopted, each by pid (the
    caller's own children, `theirs`, are left to the caller); the driver's exit code as a
    shell reports it (128 + N for a signal), or None while it runs."""
    status = None
    me = os.getpid()
    ours = [pid for pid in _children(me) if pid not in theirs]
    for pid in {child, *ours}:
        try:
            done, raw = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if done == child:
            code = os.waitstatus_to_exitcode(raw)
            status = code if code >= 0 else 128 - code
    return status


def _children(pid: int) -> list[int]:
    """The direct children of `pid` (zombies included: they are what there is to reap)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live `pid` from /proc; None when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the name: state, ppid, pgrp, session, ...
    except (OSError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else (int(fields[1]), int(fields[19]))


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of `root`."""
    table = {}
    for entry in os.listdir("/proc"):
        st = _stat(int(entry)) if entry.isdigit() else None
        if st is not None:
            table[int(entry)] = st
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, started) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = started
                todo.append(pid)
    return found


def _sweep(grace_s: float, theirs: frozenset[int] = frozenset()) -> int:
    """Stop what is left under this process (an HAProxy Ray's shutdown did not reach), but for
    the caller's own children and their trees (`theirs`): SIGTERM, up to `grace_s` to go, then
    SIGKILL, each by pid. Returns how many there were."""
    def found() -> dict[int, int]:
        spared = set(theirs)
        for pid in theirs:
            spared |= descendants(pid).keys()
        return {pid: started for pid, started in descendants(os.getpid()).items() if pid not in spared}

    return stop_found(found, grace_s)


def _sweep_mine(grace_s: float) -> int:
    """The driver's own sweep, when no supervisor is left to do it: what it started (its
    descendants, and what is left in its process group, whose parents died), as `_sweep`."""
    me, group = os.getpid(), os.getpgid(0)

    def found() -> dict[int, int]:
        left = descendants(me)
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != me and int(entry) not in left:
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        fields = f.read().rsplit(b")", 1)[1].split()
                except (OSError, IndexError):
                    continue
                if fields[0] not in (b"Z", b"X") and int(fields[2]) == group:
                    left[int(entry)] = int(fields[19])
        return left

    return stop_found(found, grace_s)


def stop_found(find: Callable[[], dict[int, int]], grace_s: float) -> int:
    """`_stop_all` on what `find` lists (pid -> start time), then on what it lists anew, up to
    SWEEP_ROUNDS rounds: a process can start another while it is being stopped, and the list
    had none of those. Serve's HAProxy manager does: it starts its HAProxy again within 0.1 s
    of its death (cluster/haproxy_guard.py), and one it started while the sweep's SIGTERM
    reached both of them outlived the sweep. Later rounds wait at most LATE_GRACE_S (those
    processes are seconds old). Returns how many processes were stopped."""
    stopped: dict[int, int] = {}
    for round_ in range(SWEEP_ROUNDS):
        left = {pid: started for pid, started in find().items() if stopped.get(pid) != started}
        if not left:
            break
        _stop_all(left, grace_s if round_ == 0 else min(grace_s, LATE_GRACE_S))
        stopped |= left
    return len(stopped)


def _stop_all(left: dict[int, int], grace_s: float) -> int:
    """SIGTERM each of `left` (pid -> start time), up to `grace_s` for them to go, then SIGKILL."""
    for pid, started in left.items():
        _signal(pid, started, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and alive(left):
        time.sleep(0.05)
    for pid in alive(left):
        _signal(pid, left[pid], signal.SIGKILL)
    return len(left)


def alive(procs: dict[int, int]) -> list[int]:
    """Those of `procs` still running: the same pid and the same start time (a pid can be reused)."""
    return [pid for pid, started in procs.items() if (_stat(pid) or (0, -1))[1] == started]


def _signal(pid: int, started: int, sig: signal.Signals) -> None:
    if alive({pid: started}):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_until_stopped(cfg: ServeConfig) -> int:
    """The driver: serve `cfg` until a SIGINT (from the parent), then let the requests in
    flight finish (`DRAIN_S` at most), stop Serve, the workers and local Ray, in that order.
    Returns 0; 1 where local Ray lost its GCS or raylet (cluster/ray_vitals.py)."""
    import ray

    from pdserve.cluster import serve_app
    from pdserve.cluster.ray_vitals import ControlPlaneLost

    _drain_on_sigint(cfg)
    try:
        serve_app.run(cfg)  # on a KeyboardInterrupt while serving, it stops Serve and the workers
    except ControlPlaneLost as e:  # drained: local Ray's processes are stopped by pid, not by Ray
        left = _sweep_mine(SWEEP_GRACE_S)
        serve_app.remove_run_files(cfg)
        print(f"[pdserve] stopped: {e}; {left} process(es) of local Ray's stopped by pid. Exiting 1",
              file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # one while starting: what has started is stopped
        if ray.is_initialized():
            try:
                serve_app.shutdown(cfg)
            except Exception as e:  # noqa: BLE001 - Ray's shutdown below stops what this could not
                print(f"[pdserve] stopping Serve while it started: {e!r}", file=sys.stderr, flush=True)
    serve_app.stop_ray(cfg)  # and the run's HAProxy directory
    return 0


def _drain_on_sigint(cfg: ServeConfig) -> None:
    """The first SIGINT starts the drain, off the main thread (which goes on serving); the drain
    ends with a second SIGINT, the KeyboardInterrupt that stops. Serve's own shutdown does not
    wait for them: a stream in flight was cut (85 of 300 tokens of the tiny model's)."""
    draining = threading.Event()

    def on_sigint(signum: int, frame: object) -> None:
        if not draining.is_set():
            draining.set()
            threading.Thread(target=_drain, args=(cfg,), name="pdserve-drain", daemon=True).start()
            return
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one stop: a later signal must not cut it short
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)


def _drain(cfg: ServeConfig) -> None:
    """Tell the gateway to take no new request (cluster/drain_flag.py), wait until it has
    none in flight (seen twice, so that the last chunks are written, the last time once every
    gateway has read the flag and, with several replicas, published its count since), DRAIN_S
    at most, then stop (SIGINT to this process)."""
    from pdserve.cluster import drain_flag, metrics_peers, ray_vitals

    deadline = time.monotonic() + DRAIN_S
    lost = ray_vitals.lost()
    try:
        drain_flag.raise_flag(cfg.port, gcs=lost is None or lost.name != "gcs_server")
    except Exception as e:  # noqa: BLE001 - Ray not up yet, or its GCS gone: the drain waits all the same
        print(f"[pdserve] telling the gateway to stop taking requests failed: {e!r}", file=sys.stderr, flush=True)
    # A gateway admits until it has read the flag: two reads of 0 before then (0.25 s apart, the
    # stop at 0.5 s) ended the drain, and a request admitted at 0.35 s was cut with no response.
    raised = time.monotonic()
    seen = raised + drain_flag.SEEN_WITHIN_S
    idle, last, done = 0, None, False
    while time.monotonic() < deadline and not done:
        read_at = time.monotonic()
        n = in_flight(cfg)
        if n is None:
            if last is None:  # no gateway yet, or it never answered: nothing to wait for
                break
            idle = 0  # it answered before: a read that failed now says nothing; wait on, to the deadline
        else:
            last = n.requests
            idle = idle + 1 if not n.requests else 0
            if n.replicas > 1:
                # The other replicas' counts are as they last published them (cluster/metrics_peers.py):
                # a request one admitted before it read the flag shows at its next publish only.
                seen = max(seen, raised + drain_flag.SEEN_WITHIN_S + metrics_peers.PUBLISH_S)
        done = idle >= 2 and read_at >= seen
        time.sleep(0.25)
    if not done and last:
        print(f"[pdserve] {last:g} request(s) still in flight after {DRAIN_S:g} s: stopping anyway", file=sys.stderr,
              flush=True)
    os.kill(os.getpid(), signal.SIGINT)


class Reading(NamedTuple):
    """One read of the gateway's /metrics: its requests in flight, and how many gateway replicas'
    counts that sums (more than one: each replica's is labelled, the others' as last published)."""

    requests: float
    replicas: int


def in_flight(cfg: ServeConfig) -> Reading | None:
    """The gateway's `pdserve:num_requests_in_flight` (admitted, not finished), or None when
    it cannot be read."""
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host  # noqa: S104 - a wildcard bind
    request = urllib.request.Request(f"http://{host}:{cfg.port}/metrics")
    key = cfg.metrics_api_key or cfg.api_key
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        # Longer than the gateway's wait for each worker's metrics (cluster/metrics.py
        # WORKER_SCRAPE_DEADLINE_S, 2 s): with one worker slow to answer, every read at 2 s gave up,
        # the drain ended at its first, and every open stream was cut.
        with urllib.request.urlopen(request, timeout=SCRAPE_TIMEOUT_S) as r:  # noqa: S310 - our own server
            text = r.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("pdserve:num_requests_in_flight")]
    return Reading(sum(values), len(values)) if values else None
