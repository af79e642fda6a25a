"""cluster/ingress_watch.py without Ray: the watch restarts HAProxy only when the HTTP
port has gone unbound for its grace time, and the call that runs in the manager actor
starts HAProxy only when Ray's own handle says it exited. The listener here is the
test's own socket on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster import ingress_watch
from pdserve.cluster.ingress_watch import IngressWatch, restart_haproxy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp (Linux)")

sys.path.insert(0, str(Path(__file__).parents[1]))
from chaos.procs import free_port  # noqa: E402


class CountingWatch(IngressWatch):
    def __init__(self, port: int) -> None:
        super().__init__(port, "node", interval_s=0.02, grace_s=0.2, backoff_s=0.3)
        self.calls: list[float] = []

    def _restart(self) -> bool:
        self.calls.append(time.monotonic())
        return True


def test_a_bound_port_is_left_alone_and_an_unbound_one_restarted_after_the_grace() -> None:
    port = free_port()
    listener = socket.socket()
    listener.bind(("127.0.0.1", port))
    listener.listen()
    watch = CountingWatch(port).start()
    try:
        time.sleep(0.5)
        assert watch.calls == []  # HAProxy listening: nothing to do
        listener.close()
        closed = time.monotonic()
        deadline = closed + 5
        while not watch.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.calls and watch.calls[0] - closed >= 0.2  # not before the grace: a reload's gap is not a death
        time.sleep(1.2)  # a cycle: backoff 0.3 s + grace 0.2 s
        assert 2 <= len(watch.calls) <= 4  # still unbound: again after each backoff, not in a loop
    finally:
        watch.stop()
    assert watch.restarts == len(watch.calls)


class FakeApi:
    def __init__(self, running: bool) -> None:
        self.running, self.started = running, threading.Event()

    def _is_running(self) -> bool:
        return self.running

    async def start(self) -> None:
        self.started.set()


def test_the_manager_starts_haproxy_only_when_its_own_has_exited() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        alive: Any = type("Manager", (), {"_haproxy": FakeApi(running=True), "event_loop": loop})()
        assert restart_haproxy(alive) is False
        dead: Any = type("Manager", (), {"_haproxy": FakeApi(running=False), "event_loop": loop})()
        assert restart_haproxy(dead) is True
        assert dead._haproxy.started.wait(5)  # on the manager's own event loop
        assert not alive._haproxy.started.is_set()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_the_managers_name_is_serves() -> None:
    """The watch finds Ray Serve's HAProxy manager by the name Serve gives it."""
    from ray.serve._private.common import NodeId  # noqa: F401 - the module the constant lives beside
    from ray.serve._private.constants import SERVE_NAMESPACE, SERVE_PROXY_NAME
    from ray.serve._private.utils import format_actor_name

    assert ingress_watch.SERVE_NAMESPACE == SERVE_NAMESPACE
    assert format_actor_name(SERVE_PROXY_NAME, "abc") == ingress_watch.PROXY_ACTOR_PREFIX + "abc"
