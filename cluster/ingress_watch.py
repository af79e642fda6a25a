"""A dead HAProxy restarted in about a second, by `pdserve serve`'s own process.

Ray Serve replaces a dead HAProxy by replacing its manager actor: 3 failed health
checks (1.5 s apart here: cluster/ingress.py), then a new actor, a new worker
process, its imports, HAProxy. On a loaded 2-core machine the new actor alone took
7.4 s to start, and /health was back only 10.9 s after a SIGKILL once. This watch
does not wait for that: a thread in the driver waits for the run's HAProxy
processes to exit (pidfds: nothing to poll while they run); when one has, and
`grace_s` later none of the run's is alive and listening on the HTTP port (a
reload's new process takes over the listeners, so a reload is not a death), it
asks the manager actor that is still alive (through Ray's `__ray_call__`) to start
HAProxy the way Ray first did (`HAProxyApi.start`: config written, the wrapper,
HAProxy), unless Ray's own handle says its HAProxy still runs. The manager's
later health checks then pass and its reloads carry on from the new process; if
the watch is too late or fails, Ray's own path still replaces the manager.

Local Ray and Linux only (pidfds, /proc).
"""

from __future__ import annotations

import logging
import os
import re
import select
import threading
from collections.abc import Callable
from typing import Any

from pdserve.cluster.leftovers import RUN_DIR_PREFIX

log = logging.getLogger(__name__)

SERVE_NAMESPACE = "serve"  # Ray Serve's own (ray/serve/_private/constants.py)
PROXY_ACTOR_PREFIX = "SERVE_PROXY_ACTOR-"  # + the node id: the HAProxy manager's name there


def listening(port: int) -> bool:
    """Whether a TCP socket listens on `port` (any address, IPv4 or IPv6). One regex over
    each table, not a parse of every line: under a flood of connections the tables have
    thousands of lines, and this runs several times a second."""
    pattern = re.compile(rf":{port:04X} [0-9A-F]+:0000 0A ")
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                if pattern.search(f.read()):
                    return True
        except OSError:
            continue
    return False


def restart_haproxy(manager: Any) -> bool:
    """Runs in the HAProxy manager actor (`__ray_call__`): schedule HAProxyApi.start on
    its event loop when its HAProxy has exited; False when it still runs."""
    api = manager._haproxy
    if api._is_running():
        return False
    loop = manager.event_loop
    loop.call_soon_threadsafe(lambda: loop.create_task(api.start()))
    return True


def haproxies(port: int, proc: str = "/proc") -> list[int]:
    """The HAProxy processes of the run on `port` (their config is in its directory,
    leftovers.haproxy_run_dir), found by their command lines."""
    mark = f"/{RUN_DIR_PREFIX}{port}/".encode()
    found = []
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{proc}/{entry.name}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if args and os.path.basename(args[0]) == b"haproxy" and any(mark in a for a in args):
            found.append(int(entry.name))
    return found


class IngressWatch:
    """The thread that restarts HAProxy when it has died (`start`, `stop`).

    It costs nothing while HAProxy runs: it waits on a pidfd of each of the run's
    HAProxy processes (Linux's process descriptors: readable when the process
    exits). When one exits (a reload's old process does too, normally), it looks
    again after `grace_s`: a HAProxy of the run alive and the port listened on is a
    reload; neither is a death, and it restarts HAProxy."""

    def __init__(self, port: int, node_id: str, grace_s: float = 0.3, backoff_s: float = 3.0,
                 find: Callable[[int], list[int]] = haproxies) -> None:
        self.port, self.node_id = port, node_id
        self.grace_s, self.backoff_s = grace_s, backoff_s
        self.find = find
        self.restarts = 0
        # The manager actor's handle, looked up once (and again after a failed call: Ray
        # replaced the manager). A lookup goes through the GCS, which runs at nice 19 behind
        # the engines (cluster/background_priority.py): under load it took seconds, and a
        # restart later than Serve's 3 failed health checks (1.5 s) races Ray's replacement
        # manager for HAProxy's ports ("Address already in use"; both lose). A call on the
        # handle goes to the actor directly.
        self._manager: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-ingress-watch", daemon=True)

    def start(self) -> IngressWatch:
        self._thread.start()
        return self

    def manager(self) -> Any:
        """The HAProxy manager actor's handle (cached)."""
        if self._manager is None:
            import ray

            self._manager = ray.get_actor(PROXY_ACTOR_PREFIX + self.node_id, namespace=SERVE_NAMESPACE)
        return self._manager

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import ray

        if ray.is_initialized():  # never started here: ray.get_actor would start a Ray
            try:
                self.manager()  # while HAProxy runs: a death then costs no lookup
            except Exception:  # noqa: BLE001 - not up yet: looked up when needed
                log.debug("pdserve: HAProxy manager not found yet", exc_info=True)
        while not self._stop.is_set():
            pids = self.find(self.port)
            if pids and listening(self.port):
                self._wait_for_an_exit(pids)
                self._stop.wait(self.grace_s)  # a reload's new process takes over meanwhile
                continue
            self._stop.wait(self.grace_s)
            if self._stop.is_set() or (self.find(self.port) and listening(self.port)):
                continue
            if self._restart():
                self.restarts += 1
            self._stop.wait(self.backoff_s)  # HAProxy's start, or Ray's own replacement, takes this long

    def _wait_for_an_exit(self, pids: list[int]) -> None:
        """Until one of `pids` exits (or the watch stops)."""
        fds = []
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except OSError:  # gone already
                break
        try:
            while len(fds) == len(pids) and not self._stop.is_set():
                ready, _, _ = select.select(fds, [], [], 1.0)
                if ready:
                    return
        finally:
            for fd in fds:
                os.close(fd)

    def _restart(self) -> bool:
        import ray

        try:
            started = bool(ray.get(self.manager().__ray_call__.remote(restart_haproxy), timeout=5))
        except Exception as e:  # noqa: BLE001 - a manager being replaced by Ray: Ray's path goes on
            self._manager = None  # its replacement is looked up next time
            log.warning("pdserve: nothing listens on port %d and the HAProxy manager did not answer (%r); "
                        "Ray Serve replaces it", self.port, e)
            return False
        if started:
            log.warning("pdserve: HAProxy had exited (nothing listened on port %d); started it again", self.port)
        return started
