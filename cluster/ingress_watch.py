"""A dead HAProxy restarted in about a second, by `pdserve serve`'s own process.

Ray Serve replaces a dead HAProxy by replacing its manager actor: 3 failed health
checks (0.5 s apart here: cluster/ingress.py), then a new actor, a new worker
process, its imports, HAProxy. On a loaded 2-core machine the new actor alone took
7.4 s to start, and /health was back 6-11 s after a SIGKILL. This watch does not
wait for that: a thread in the driver looks at the HTTP port every `interval_s`;
when nothing has listened there for `grace_s` (HAProxy's reloads hand their
listeners over, so a reload never leaves the port unbound), it asks the manager
actor that is still alive (through Ray's `__ray_call__`) to start HAProxy the way
Ray first did (`HAProxyApi.start`: config written, the wrapper, HAProxy), unless
Ray's own handle says its HAProxy still runs. The manager's later health checks
then pass and its reloads carry on from the new process; if the watch is too late
or fails, Ray's own path still replaces the manager.

Local Ray and Linux only (it reads /proc/net/tcp, as cluster/leftovers.py does).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from pdserve.cluster.leftovers import listening_inodes

log = logging.getLogger(__name__)

SERVE_NAMESPACE = "serve"  # Ray Serve's own (ray/serve/_private/constants.py)
PROXY_ACTOR_PREFIX = "SERVE_PROXY_ACTOR-"  # + the node id: the HAProxy manager's name there


def restart_haproxy(manager: Any) -> bool:
    """Runs in the HAProxy manager actor (`__ray_call__`): schedule HAProxyApi.start on
    its event loop when its HAProxy has exited; False when it still runs."""
    api = manager._haproxy
    if api._is_running():
        return False
    loop = manager.event_loop
    loop.call_soon_threadsafe(lambda: loop.create_task(api.start()))
    return True


class IngressWatch:
    """The thread that restarts HAProxy when the HTTP port goes unbound (`start`, `stop`)."""

    def __init__(self, port: int, node_id: str, interval_s: float = 0.1, grace_s: float = 0.3,
                 backoff_s: float = 3.0) -> None:
        self.port, self.node_id = port, node_id
        self.interval_s, self.grace_s, self.backoff_s = interval_s, grace_s, backoff_s
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-ingress-watch", daemon=True)

    def start(self) -> IngressWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        unbound_since: float | None = None
        while not self._stop.wait(self.interval_s):
            if listening_inodes(self.port):
                unbound_since = None
                continue
            now = time.monotonic()
            unbound_since = unbound_since or now
            if now - unbound_since < self.grace_s:
                continue
            if self._restart():
                self.restarts += 1
            unbound_since = None
            self._stop.wait(self.backoff_s)  # HAProxy's start, or Ray's own replacement, takes this long

    def _restart(self) -> bool:
        import ray

        try:
            manager = ray.get_actor(PROXY_ACTOR_PREFIX + self.node_id, namespace=SERVE_NAMESPACE)
            started = bool(ray.get(manager.__ray_call__.remote(restart_haproxy), timeout=5))
        except Exception as e:  # noqa: BLE001 - a manager being replaced by Ray: Ray's path goes on
            log.warning("pdserve: nothing listens on port %d and the HAProxy manager did not answer (%r); "
                        "Ray Serve replaces it", self.port, e)
            return False
        if started:
            log.warning("pdserve: HAProxy had exited (nothing listened on port %d); started it again", self.port)
        return started
