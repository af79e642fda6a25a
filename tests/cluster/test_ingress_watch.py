"""cluster/haproxy_guard.py and cluster/ingress_watch.py without Ray: the guard, on an
event loop in its own thread as in Serve's HAProxy manager actor, starts HAProxy again
when the manager's process has died, once per death (a slow start is not started
twice), not when a reload replaced it, not when a stop was asked for, and again after
a failed start. The "HAProxy" processes here are the test's own sleepers, killed by pid."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pdserve.cluster import ingress_watch
from pdserve.cluster.haproxy_guard import GUARD_ATTR, HAProxyGuard, install_guard
from pdserve.cluster.ingress_watch import IngressWatch

SLEEPER = (sys.executable, "-c", "import time; time.sleep(60)")


class FakeApi:
    """HAProxyApi's members the guard uses, over sleepers. As in Ray's, `_proc` is set only
    once a start has waited for the new process to come up (`start_s`)."""

    def __init__(self, start_s: float = 0.3) -> None:
        self._proc: Any = None
        self.start_s = start_s
        self.starts = 0
        self.fail_next = 0
        self.pids: list[int] = []  # every sleeper started: the test kills them all at the end

    async def _spawn(self) -> Any:
        proc = await asyncio.create_subprocess_exec(*SLEEPER)
        self.pids.append(proc.pid)
        await asyncio.sleep(self.start_s)
        return proc

    async def start(self) -> None:
        self.starts += 1
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("HAProxy crashed during startup: Address already in use")
        self._proc = await self._spawn()

    async def stop(self) -> None:
        proc = self._proc
        proc.kill()
        await proc.wait()
        self._proc = None

    async def reload(self) -> None:
        """A graceful reload: the new process takes over and the old one exits before
        `_proc` names the new one (Ray's -sf, then its wait for the new one's answer)."""
        old = self._proc
        new = await asyncio.create_subprocess_exec(*SLEEPER)
        self.pids.append(new.pid)
        old.kill()
        await old.wait()
        await asyncio.sleep(self.start_s)
        self._proc = new


class FakeManager:
    """HAProxyManager's members the guard uses; `call` runs a coroutine on its loop."""

    def __init__(self, api: FakeApi) -> None:
        self._haproxy = api
        self.event_loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.event_loop.run_forever, daemon=True)
        self._thread.start()
        self._reload_lock: asyncio.Lock = self.call(self._make_lock)
        self._haproxy_start_task = asyncio.run_coroutine_threadsafe(self._first_start(), self.event_loop)
        self._haproxy_start_task.result(10)
        self._haproxy_start_task = self.call(self._done_task)

    @staticmethod
    async def _make_lock() -> asyncio.Lock:
        return asyncio.Lock()

    async def _first_start(self) -> None:
        await self._haproxy.start()

    @staticmethod
    async def _done_task() -> asyncio.Task[None]:
        async def nothing() -> None:
            return None
        task = asyncio.get_running_loop().create_task(nothing())
        await task
        return task

    def call(self, fn: Callable[[], Any], timeout_s: float = 20) -> Any:
        return asyncio.run_coroutine_threadsafe(fn(), self.event_loop).result(timeout_s)

    async def reload(self) -> None:
        async with self._reload_lock:
            await self._haproxy.reload()

    def close(self) -> None:
        self.event_loop.call_soon_threadsafe(self.event_loop.stop)
        self._thread.join(5)


@contextlib.contextmanager
def guarded(start_s: float = 0.3) -> Iterator[tuple[FakeManager, HAProxyGuard]]:
    api = FakeApi(start_s)
    manager = FakeManager(api)
    try:
        assert install_guard(manager) == (True, 0)
        yield manager, getattr(manager, GUARD_ATTR)
    finally:
        manager.close()
        for pid in api.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def wait_until(cond: Callable[[], bool], timeout_s: float = 10) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout_s, "not within the deadline"
        time.sleep(0.01)
    return time.monotonic() - start


def test_a_death_is_restarted_once_and_within_a_second() -> None:
    with guarded(start_s=1.5) as (manager, guard):  # a slow start: longer than the poll, many times over
        api = manager._haproxy
        dead = api._proc
        os.kill(dead.pid, signal.SIGKILL)
        took = wait_until(lambda: api._proc is not dead)
        assert took < 1.5 + 1.0  # the start's own 1.5 s and the poll
        assert api.starts == 2 and guard.restarts == 1  # the first start, and one restart: not one per poll
        assert api._proc.returncode is None
        time.sleep(0.5)
        assert api.starts == 2  # the new one runs: nothing more


def test_a_reload_is_not_a_death() -> None:
    with guarded() as (manager, guard):
        api = manager._haproxy
        manager.call(manager.reload)  # the old process exits before _proc names the new one
        time.sleep(0.5)
        assert api.starts == 1 and guard.restarts == 0
        # ... and the guard follows the new process: its death is restarted
        os.kill(api._proc.pid, signal.SIGKILL)
        wait_until(lambda: guard.restarts == 1)


def test_a_stop_is_not_a_death_and_ends_the_guard() -> None:
    with guarded() as (manager, guard):
        api = manager._haproxy
        manager.call(api.stop)  # the manager's shutdown: through the wrapped stop
        wait_until(lambda: guard.task is not None and guard.task.done())
        assert api._proc is None and api.starts == 1 and guard.restarts == 0


def test_a_failed_start_is_tried_again_after_the_backoff() -> None:
    with guarded() as (manager, guard):
        api = manager._haproxy
        api.fail_next = 1
        os.kill(api._proc.pid, signal.SIGKILL)
        wait_until(lambda: guard.restarts == 1)
        assert guard.failed_starts == 1 and api.starts == 3 and api._proc.returncode is None


def test_a_second_install_finds_the_guard() -> None:
    with guarded() as (manager, guard):
        os.kill(manager._haproxy._proc.pid, signal.SIGKILL)
        wait_until(lambda: guard.restarts == 1)
        assert install_guard(manager) == (False, 1)
        assert getattr(manager, GUARD_ATTR) is guard


class Answers(IngressWatch):
    """The watch with its actor calls answered by `answers` (an exception: a dead manager)."""

    def __init__(self, answers: list[Any]) -> None:
        super().__init__("node")
        self.answers = answers

    def call(self, fn: Any) -> Any:
        assert fn is install_guard
        self._manager = "handle"
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_the_watch_guards_a_replacement_manager_and_reports_restarts(caplog: pytest.LogCaptureFixture) -> None:
    watch = Answers([RuntimeError("no such actor yet"), (True, 0), (False, 0), (False, 2),
                     RuntimeError("actor died"), (True, 0), (False, 1)])
    with caplog.at_level("WARNING", logger="pdserve"):
        watch.check()
        assert watch._manager is None and watch.installs == 0  # looked up again next time
        watch.check()
        watch.check()
        assert watch.installs == 1 and not caplog.records
        watch.check()
        assert "started again (2 time(s)" in caplog.text
        watch.check()
        assert watch._manager is None
        watch.check()
        assert watch.installs == 2 and "replaced the HAProxy manager" in caplog.text
        watch.check()
        assert watch.restarts == 1 and "started again (1 time(s)" in caplog.text


def test_the_managers_name_is_serves() -> None:
    """The watch finds Ray Serve's HAProxy manager by the name Serve gives it."""
    from ray.serve._private.constants import SERVE_NAMESPACE, SERVE_PROXY_NAME
    from ray.serve._private.utils import format_actor_name

    assert ingress_watch.SERVE_NAMESPACE == SERVE_NAMESPACE
    assert format_actor_name(SERVE_PROXY_NAME, "abc") == ingress_watch.PROXY_ACTOR_PREFIX + "abc"


def test_the_guard_uses_only_what_rays_manager_has() -> None:
    """The members the guard reads exist on Ray Serve's HAProxyManager and HAProxyApi (a Ray
    that renamed one fails here, not on the first HAProxy death)."""
    import inspect

    from ray.serve._private import haproxy

    source = inspect.getsource(haproxy)  # HAProxyManager is Ray's actor class: its methods are wrapped
    for member in ("self._haproxy = HAProxyApi(", "self._reload_lock = asyncio.Lock()",
                   "self._haproxy_start_task = self.event_loop.create_task(self._haproxy.start())",
                   "self._proc = await self._start_and_wait_for_haproxy(", "await self._haproxy.stop()",
                   "async with self._reload_lock:\n            await self._haproxy_start_task\n"
                   "            await self._haproxy.reload()"):
        assert member in source, member
    assert callable(haproxy.HAProxyApi.start) and callable(haproxy.HAProxyApi.stop)


def test_the_guard_imports_nothing_heavy_into_the_manager() -> None:
    """Ray runs `install_guard` in the manager by importing its module: that import must not
    bring torch or transformers (seconds on a loaded node, on the manager's event loop, while
    its HAProxy may be down; seen with py-spy before pdserve's names became lazy)."""
    import subprocess

    code = ("import sys, pdserve.cluster.haproxy_guard, pdserve.cluster.ingress_watch; "
            "print(sorted(m for m in ('torch', 'transformers', 'ray', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_a_process_that_keeps_dying_soon_after_its_start_waits_longer_each_time() -> None:
    # A HAProxy that crashes on its first request: restarted at once each time, the manager
    # spawned it ~10 times a second. The first death is restarted at once; each later one
    # within STABLE_S of its start waits backoff_s, then twice that, and so on.
    api = FakeApi(start_s=0.05)
    manager = FakeManager(api)
    guard = HAProxyGuard(manager, poll_s=0.02, backoff_s=0.2)

    def start() -> None:
        guard.task = manager.event_loop.create_task(guard.run())

    manager.event_loop.call_soon_threadsafe(start)
    try:
        took = []
        for _ in range(4):
            proc = api._proc
            os.kill(proc.pid, signal.SIGKILL)
            took.append(wait_until(lambda: api._proc is not proc and api._proc.returncode is None))
        assert took[0] < 0.5, took  # Ray's own start ran long enough: at once
        assert took[1] >= 0.2 and took[2] >= 0.4 and took[3] >= 0.8, took
        assert guard.restarts == 4 and guard.failed_starts == 0
    finally:
        manager.call(api.stop)
        manager.close()
        for pid in api.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_serving_waits_for_the_first_guard() -> None:
    # `pdserve serve` says "serving" once the first manager has its guard (wait_installed), so a
    # HAProxy that dies after that line is restarted by the guard, not by Ray's slower path.
    watch = Answers([RuntimeError("no such actor yet"), (True, 0)])
    assert not watch.wait_installed(0.01)
    watch.check()
    assert not watch.wait_installed(0.01)
    watch.check()
    assert watch.wait_installed(0.0)
