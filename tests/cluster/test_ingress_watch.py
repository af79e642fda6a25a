"""cluster/ingress_watch.py without Ray: the watch restarts HAProxy when the run's
HAProxy has died (its process gone, the port not listened on), not when a reload
replaced it, and the call that runs in the manager actor starts HAProxy only when
Ray's own handle says it exited. The processes and the listener here are the test's
own (sleepers, a socket on 127.0.0.1), stopped by pid."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster import ingress_watch
from pdserve.cluster.ingress_watch import IngressWatch, haproxies, listening, restart_haproxy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp (Linux)")

sys.path.insert(0, str(Path(__file__).parents[1]))
from chaos.procs import free_port  # noqa: E402


class CountingWatch(IngressWatch):
    """The watch over the test's own stand-ins: `procs` for the run's HAProxy processes."""

    def __init__(self, port: int, procs: list[subprocess.Popen[bytes]]) -> None:
        super().__init__(port, "node", grace_s=0.2, backoff_s=0.3,
                         find=lambda _: [p.pid for p in procs if p.poll() is None])
        self.calls: list[float] = []

    def _restart(self) -> bool:
        self.calls.append(time.monotonic())
        return True


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_reload_is_left_alone_and_a_death_restarted_after_the_grace() -> None:
    port = free_port()
    listener = socket.socket()
    listener.bind(("127.0.0.1", port))
    listener.listen()
    procs = [_sleeper()]
    watch = CountingWatch(port, procs).start()
    try:
        assert listening(port)
        time.sleep(0.5)
        assert watch.calls == []  # HAProxy running: nothing to do
        procs.append(_sleeper())  # a reload: a new process, the old one exits, the port stays listened on
        time.sleep(0.2)
        procs[0].kill()
        procs[0].wait(10)
        time.sleep(0.8)
        assert watch.calls == []
        procs[1].kill()  # a death: the process and its listener gone
        listener.close()
        procs[1].wait(10)
        died = time.monotonic()
        deadline = died + 5
        while not watch.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.calls and 0.2 <= watch.calls[0] - died < 2.0  # after the grace, not at once
        time.sleep(1.2)  # a cycle: backoff 0.3 s + grace 0.2 s
        assert 2 <= len(watch.calls) <= 4  # still dead: again after each backoff, not in a loop
    finally:
        watch.stop()
        for p in procs:
            p.kill()
            p.wait(10)
    assert not listening(port)
    assert watch.restarts == len(watch.calls)


def test_the_runs_haproxies_are_found_by_their_config_directory(tmp_path: Path) -> None:
    """A process named haproxy with a config in pdserve-haproxy-<port>/ is the run's; one
    of another port's run, or not named haproxy, is not."""
    run = tmp_path / "pdserve-haproxy-18123" / "node"
    run.mkdir(parents=True)
    other = tmp_path / "pdserve-haproxy-18124" / "node"
    other.mkdir(parents=True)
    script = "import time; time.sleep(60)"
    mine = subprocess.Popen(["haproxy", "-c", script, "-f", str(run / "haproxy.cfg")], executable=sys.executable)
    theirs = subprocess.Popen(["haproxy", "-c", script, "-f", str(other / "haproxy.cfg")], executable=sys.executable)
    named = subprocess.Popen([sys.executable, "-c", script, "-f", str(run / "haproxy.cfg")])
    try:
        deadline = time.monotonic() + 10
        while mine.pid not in haproxies(18123) and time.monotonic() < deadline:
            time.sleep(0.05)
        found = haproxies(18123)
        assert mine.pid in found and theirs.pid not in found and named.pid not in found
    finally:
        for p in (mine, theirs, named):
            p.kill()
            p.wait(10)


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
