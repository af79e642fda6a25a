"""`pdserve serve`'s side of HAProxy's supervision: keep a guard in the HAProxy manager.

The restart itself happens inside Ray Serve's HAProxy manager actor
(cluster/haproxy_guard.py). This thread, in the driver, installs that guard in the
manager once it exists (through Ray's `__ray_call__`), and again in any manager
that replaces it (Serve's controller replaces one whose HAProxy it finds dead or
whose health checks fail: then the new one gets a guard within `check_s`). It
also reports what the guard did, so an operator reads in `pdserve serve`'s output
that HAProxy was restarted. The calls here are off the restart's path: a slow
one (the node saturated, the GCS at nice 19) delays nothing but this report.

Local Ray only (serve_app.run starts it there): the HAProxy of a cluster `pdserve
serve` joined is that cluster's, restarted by Ray's own path.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pdserve.cluster.haproxy_guard import install_guard

log = logging.getLogger(__name__)

SERVE_NAMESPACE = "serve"  # Ray Serve's own (ray/serve/_private/constants.py)
PROXY_ACTOR_PREFIX = "SERVE_PROXY_ACTOR-"  # + the node id: the HAProxy manager's name there
CHECK_S = 3.0  # between checks that the manager (or its replacement) has a guard
FIRST_CHECK_S = 0.5  # until the first manager has one
CALL_TIMEOUT_S = 30.0  # an actor call on a saturated node can take seconds; this one waits for nothing urgent


class IngressWatch:
    """The thread that keeps a HAProxy guard in the node's HAProxy manager (`start`, `stop`)."""

    def __init__(self, node_id: str, check_s: float = CHECK_S) -> None:
        self.node_id, self.check_s = node_id, check_s
        self.installs = 0  # managers given a guard (more than one: Ray replaced the manager)
        self.restarts = 0  # HAProxy restarts the current manager's guard reported
        self._manager: Any = None  # the manager's handle, looked up again when a call on it fails
        self._first_install = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-ingress-watch", daemon=True)

    def start(self) -> IngressWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)  # a call in flight ends on its own (a daemon thread): a stop waits for none

    def wait_installed(self, timeout_s: float) -> bool:
        """Whether the first manager had its guard within `timeout_s` (at once once it has)."""
        return self._first_install.wait(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check()
            # Until the first install, often: the manager is starting, and HAProxy with it.
            self._stop.wait(self.check_s if self.installs else FIRST_CHECK_S)

    def call(self, fn: Any) -> Any:
        """`fn(manager)` run in the manager actor (its handle looked up by name when not cached)."""
        import ray

        if self._manager is None:
            self._manager = ray.get_actor(PROXY_ACTOR_PREFIX + self.node_id, namespace=SERVE_NAMESPACE)
        return ray.get(self._manager.__ray_call__.remote(fn), timeout=CALL_TIMEOUT_S)

    def check(self) -> None:
        """Install the guard where it is missing; report restarts it made since the last check."""
        try:
            installed, restarts = self.call(install_guard)
        except Exception as e:  # noqa: BLE001 - not up yet, or replaced by Ray: looked up again next time
            self._manager = None
            log.debug("pdserve: the HAProxy manager did not answer (%r)", e)
            return
        if installed:
            self.installs += 1
            self.restarts = 0
            self._first_install.set()
            if self.installs > 1:
                log.warning("pdserve: Ray Serve replaced the HAProxy manager; its new HAProxy is guarded too")
        if restarts > self.restarts:
            log.warning("pdserve: HAProxy had exited and was started again (%d time(s) in this manager)", restarts)
        self.restarts = restarts
