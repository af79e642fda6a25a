"""Clean starts after dirty stops (cluster/leftovers.py): a port this run binds that an
earlier run's orphaned HAProxy still holds is cleared; any other holder is reported,
never killed; every port pdserve binds moves with a flag.

No Ray cluster: the holders are small Python listeners the tests start on 127.0.0.1
(ephemeral ports), some with a command line crafted to look like Ray Serve's HAProxy
(`haproxy -db -f <dir>/<node>/haproxy.cfg`, argv[0] set by Popen's `executable=`).
Each test kills only the processes it started, by pid, whatever happens.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster import leftovers
from pdserve.cluster.leftovers import PortInUseError, check_ports, haproxy_run_dir, is_ray_haproxy

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc (Linux)")

# Listens on a free port of 127.0.0.1, says which, and waits (at most a minute).
LISTEN = ("import os, socket, time\n"
          "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
          "print('listener', os.getpid(), s.getsockname()[1], flush=True)\n"
          "time.sleep(60)\n")
# `LAUNCH exit|stay PYTHON ARGV...`: runs PYTHON with ARGV (ARGV[0] as its argv[0]) in
# its own session, says its pid, and exits (`stay`: waits instead): the child is orphaned.
LAUNCH = ("import os, subprocess, sys, time\n"
          "stay = sys.argv[1] == 'stay'\n"
          "p = subprocess.Popen(sys.argv[3:], executable=sys.argv[2], start_new_session=True)\n"
          "print('child', p.pid, flush=True)\n"
          "if stay: time.sleep(60)\n")


def _alive(pid: int) -> bool:
    return leftovers.process(pid) is not None


def _kill(pid: int, cmdline: tuple[str, ...]) -> None:
    """SIGKILL `pid` if it is still the process this test started."""
    holder = leftovers.process(pid)
    if holder is not None and holder.cmdline == cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _read_lines(proc: subprocess.Popen[str], n: int) -> dict[str, list[int]]:
    out = {}
    for _ in range(n):
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, "the helper process said nothing"
        word, *numbers = line.split()
        out[word] = [int(x) for x in numbers]
    return out


@contextlib.contextmanager
def plain_listener() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A Python process (a child of the test) listening on a free port."""
    proc = subprocess.Popen([sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
    try:
        ((pid, port),) = _read_lines(proc, 1).values()
        assert pid == proc.pid
        yield proc, port
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout:
            proc.stdout.close()


@contextlib.contextmanager
def fake_haproxy(config: str, parent: str | None = None) -> Iterator[tuple[int, int, tuple[str, ...]]]:
    """A listener whose command line is Ray Serve's HAProxy's (`haproxy -db -f config`):
    orphaned (its launcher exited) or, with `parent`, the child of a live process
    named `parent`. Yields its pid, its port and its command line."""
    argv = ["haproxy", "-c", LISTEN, "-db", "-f", config]
    launch = [parent or "python", "-c", LAUNCH, "stay" if parent else "exit", sys.executable, *argv]
    launcher = subprocess.Popen(launch, executable=sys.executable, stdout=subprocess.PIPE, text=True)
    pid = -1
    try:
        said = _read_lines(launcher, 2)
        (pid,) = said["child"]
        assert said["listener"][0] == pid
        port = said["listener"][1]
        if parent is None:
            launcher.wait(timeout=10)
            deadline = time.monotonic() + 10
            while (holder := leftovers.process(pid)) is not None and holder.ppid == launcher.pid:
                assert time.monotonic() < deadline, "the fake HAProxy was not reparented"
                time.sleep(0.01)
        yield pid, port, tuple(argv)
    finally:
        if pid > 0:
            _kill(pid, tuple(argv))
        launcher.kill()
        launcher.wait()
        if launcher.stdout:
            launcher.stdout.close()


# -- (a) another process holds the port: reported, not killed -----------------------------


def test_a_port_held_by_another_process_is_reported_with_its_pid_and_not_killed() -> None:
    with plain_listener() as (proc, port):
        with pytest.raises(PortInUseError) as e:
            check_ports({port: "--port"}, timeout_s=1.0)
        msg = str(e.value)
        assert f"port {port}" in msg and f"pid {proc.pid}" in msg and f"`kill {proc.pid}`" in msg
        assert "--port" in msg and sys.executable in msg  # its command line
        assert proc.poll() is None and _alive(proc.pid)
        assert leftovers.listening_inodes(port)


def test_pdserve_serve_says_which_process_holds_its_port(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`pdserve serve` checks before Ray starts, and exits 2 with `pdserve: error: ...`."""
    from pdserve.cluster import cli, serve_app

    def no_ray(*a: Any, **k: Any) -> None:
        raise AssertionError("Ray started although a port is taken")

    monkeypatch.setattr(serve_app, "starts_local_ray", lambda: True)
    monkeypatch.setattr(serve_app, "init_ray", no_ray)
    with plain_listener() as (proc, port):
        code = cli.main(["serve", "--model", "tiny", "--ingress", "proxy", "--port", str(port)])
        err = capsys.readouterr().err
        assert code == 2
        # (after the tiny model's making, where this is the session's first use of it)
        assert err[err.index("pdserve: error:"):].startswith(f"pdserve: error: port {port} is in use by pid {proc.pid}")
        assert f"kill {proc.pid}" in err and "--port" in err
        assert proc.poll() is None


def test_free_ports_pass() -> None:
    with plain_listener() as (proc, port):
        pass
    assert check_ports({port: "--port"}) == []


def test_a_stopped_run_removes_its_files_unless_its_port_is_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run on a port of its own left /tmp/pdserve-haproxy-<port> and its CPU workers'
    /dev/shm files behind (hundreds a day from the tests); its stop removes them, unless
    something still listens on the port (another run, whose files they are)."""
    from pdserve.cluster import serve_app
    from pdserve.workers.cpu_turns import lending_dir, turns_path

    monkeypatch.setattr(serve_app.ray, "shutdown", lambda: None)
    monkeypatch.setattr(leftovers, "time", _FastClock())
    with plain_listener() as (_, port):
        app = f"{serve_app.NAMESPACE}-{port}"
        made = [haproxy_run_dir(port), lending_dir(app)]
        try:
            os.makedirs(os.path.join(made[0], "node"), mode=0o700)
            os.makedirs(made[1], mode=0o700)
            for f in (os.path.join(made[0], "node", "haproxy.cfg"), os.path.join(made[1], "busy-1"), turns_path(app)):
                open(f, "w").close()
            made.append(turns_path(app))
            serve_app.stop_ray(_cfg(["--port", str(port)]))  # the port is in use: kept
            assert all(os.path.exists(p) for p in made)
        except BaseException:
            for p in made:
                shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.unlink(p)
            raise
    serve_app.stop_ray(_cfg(["--port", str(port)]))
    assert not [p for p in made if os.path.lexists(p)]
    assert leftovers.remove_run_dir(port)  # nothing there: done


class _FastClock:
    """leftovers' `time` with sleeps that pass at once: a wait for a port runs out at once."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_a_link_in_place_of_the_haproxy_directory_is_not_followed(tmp_path: Path) -> None:
    with plain_listener() as (_, port):
        pass
    run_dir = haproxy_run_dir(port)
    (tmp_path / "keep").write_text("x")
    os.symlink(tmp_path, run_dir)
    try:
        assert not leftovers.remove_run_dir(port)
        assert (tmp_path / "keep").read_text() == "x"
    finally:
        os.unlink(run_dir)


# -- (b) an earlier run's orphaned HAProxy: stopped ---------------------------------------


@pytest.mark.parametrize("where", ["ray-default", "pdserve-run-dir"])
def test_an_orphaned_ray_serve_haproxy_is_stopped_and_the_port_freed(
        where: str, caplog: pytest.LogCaptureFixture) -> None:
    base = leftovers.RAY_HAPROXY_DIR if where == "ray-default" else haproxy_run_dir(os.getpid())
    config = os.path.join(base, f"test-node-{os.getpid()}", "haproxy.cfg")
    with fake_haproxy(config) as (pid, port, cmdline):
        holder = leftovers.process(pid)
        assert holder is not None and holder.cmdline == cmdline
        assert leftovers.is_leftover(holder)
        with caplog.at_level(logging.WARNING, logger=leftovers.__name__):
            assert check_ports({port: "--haproxy-metrics-port"}, timeout_s=5.0) == [pid]
        assert not _alive(pid)
        assert not leftovers.listening_inodes(port)
        (record,) = caplog.records
        assert f"pid {pid}" in record.getMessage() and f"port {port}" in record.getMessage()
        assert "orphaned" in record.getMessage()


@pytest.mark.parametrize("linger_s, freed", [(0.3, True), (30.0, False)])
def test_a_listener_that_outlives_the_stopped_orphan_is_waited_for(monkeypatch: pytest.MonkeyPatch,
                                                                   linger_s: float, freed: bool) -> None:
    """Seen between two benchmark runs: the orphan was gone, no process held the port,
    and the kernel still listed the listener; the next run took it for another user's
    process. A listener that goes within the timeout is waited for; one that stays is
    still reported."""
    config = os.path.join(haproxy_run_dir(os.getpid()), f"test-node-{os.getpid()}", "haproxy.cfg")
    real_stop, real_inodes = leftovers.stop, leftovers.listening_inodes
    stopped_at: list[float] = []

    def stop(holder: leftovers.Holder, timeout_s: float = 5.0) -> None:
        real_stop(holder, timeout_s)
        stopped_at.append(time.monotonic())

    def inodes(port: int) -> set[int]:
        if stopped_at and time.monotonic() < stopped_at[0] + linger_s:
            return {999_999_999}  # no process has this socket
        return set(real_inodes(port))

    monkeypatch.setattr(leftovers, "stop", stop)
    monkeypatch.setattr(leftovers, "listening_inodes", inodes)
    with fake_haproxy(config) as (pid, port, _):
        if freed:
            assert check_ports({port: "--port"}, timeout_s=2.0) == [pid]
        else:
            with pytest.raises(PortInUseError, match=f"port {port} is"):
                check_ports({port: "--port"}, timeout_s=0.5)
        assert not _alive(pid)


def test_a_live_ray_serve_haproxy_is_not_touched() -> None:
    """An HAProxy whose parent is alive and a Ray worker (`ray::...`) belongs to a
    running Ray Serve: reported with the flag that moves the port, not stopped."""
    config = os.path.join(leftovers.RAY_HAPROXY_DIR, f"test-node-{os.getpid()}", "haproxy.cfg")
    with fake_haproxy(config, parent="ray::HAProxyManager") as (pid, port, _):
        with pytest.raises(PortInUseError, match=rf"(?s)pid {pid}\b.*still running.*kill {pid}.*--haproxy-stats-port"):
            check_ports({port: "--haproxy-stats-port"}, timeout_s=1.0)
        assert _alive(pid)


def test_an_orphaned_haproxy_that_is_not_ray_serves_is_not_touched() -> None:
    with fake_haproxy(f"/nonexistent/pdserve-test-{os.getpid()}/haproxy.cfg") as (pid, port, _):
        with pytest.raises(PortInUseError, match=rf"pid {pid}\b"):
            check_ports({port: "--port"}, timeout_s=1.0)
        assert _alive(pid)


@pytest.mark.parametrize("cmdline, ray_serves", [
    (("/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy", "-db", "-f",
      "/tmp/haproxy-serve/0123abcd/haproxy.cfg", "-dR"), True),
    (("haproxy", "-db", "-f", "/tmp/pdserve-haproxy-8000/0123abcd/haproxy.cfg", "-sf", "77"), True),
    (("haproxy", "-f", "/etc/haproxy/haproxy.cfg"), False),
    (("haproxy", "-f", "/tmp/haproxy-serve/../etc/haproxy.cfg"), False),
    (("haproxy", "-f", "/tmp/pdserve-haproxy-x/n/haproxy.cfg"), False),
    (("haproxy", "/tmp/haproxy-serve/n/haproxy.cfg"), False),
    (("nginx", "-f", "/tmp/haproxy-serve/n/haproxy.cfg"), False),
    ((), False),
])
def test_what_counts_as_ray_serves_haproxy(cmdline: tuple[str, ...], ray_serves: bool) -> None:
    assert is_ray_haproxy(cmdline) is ray_serves


# -- (c) every port pdserve binds moves with a flag ---------------------------------------


MOVED = ["--port", "18000", "--haproxy-metrics-port", "19101", "--haproxy-stats-port", "18404",
         "--haproxy-fallback-port", "18500"]


def _cfg(argv: list[str]) -> Any:
    from pdserve.cluster.cli import build_parser, settings_from_flags
    from pdserve.cluster.serve_config import serve_config

    return serve_config(settings_from_flags(build_parser().parse_args(["serve", "--model", "/m", *argv])))


@pytest.fixture
def own_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A temporary directory of the test's own for what `haproxy_env` writes (the wrapper in
    each run's HAProxy directory): in /tmp itself it would be left there, and a server running on
    the same port (`make run` on 8000 beside `make test`) would have its wrapper written over."""
    own = tempfile.mkdtemp(prefix="pdh", dir="/tmp")  # short: Ray's socket paths go under it
    monkeypatch.setattr(tempfile, "tempdir", own)
    try:
        yield own
    finally:
        shutil.rmtree(own, ignore_errors=True)


def test_the_flags_move_every_port_and_the_haproxy_files(own_tmp: str) -> None:
    from pdserve.cluster.serve_app import bound_ports, haproxy_env

    cfg = _cfg(MOVED)
    assert (cfg.port, cfg.haproxy_metrics_port, cfg.haproxy_stats_port, cfg.haproxy_fallback_port) == (
        18000, 19101, 18404, 18500)
    assert bound_ports(cfg) == {18000: "--port", 19101: "--haproxy-metrics-port", 18404: "--haproxy-stats-port",
                                18500: "--haproxy-fallback-port"}
    env = haproxy_env(cfg)
    assert env["RAY_SERVE_HAPROXY_METRICS_PORT"] == "19101" and env["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
    assert env["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] == "18500"
    run_dir = haproxy_run_dir(18000)
    assert run_dir == os.path.join(own_tmp, "pdserve-haproxy-18000")
    for key in ("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "RAY_SERVE_HAPROXY_SOCKET_PATH",
                "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH", "RAY_SERVE_HAPROXY_SERVER_STATE_FILE"):
        assert os.path.dirname(env[key]) == run_dir, key
    assert env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"] == run_dir
    # What the check treats as Ray Serve's HAProxy includes what this run will start.
    assert is_ray_haproxy(("haproxy", "-db", "-f", os.path.join(run_dir, "node", "haproxy.cfg")))
    # Two runs (two HTTP ports) never share a file.
    other = haproxy_env(_cfg(["--port", "18001"]))
    assert not {v for k, v in env.items() if "PORT" not in k} & set(other.values())


def test_defaults_are_ray_serves_and_the_proxy_ingress_binds_only_the_http_port() -> None:
    from pdserve.cluster.serve_app import bound_ports

    cfg = _cfg([])
    assert (cfg.port, cfg.haproxy_metrics_port, cfg.haproxy_stats_port, cfg.haproxy_fallback_port) == (
        8000, 9101, 8404, 8500)
    assert bound_ports(cfg) == {8000: "--port", 9101: "--haproxy-metrics-port", 8404: "--haproxy-stats-port",
                                8500: "--haproxy-fallback-port"}
    assert bound_ports(_cfg(["--ingress", "proxy"])) == {8000: "--port"}


def test_the_env_names_are_the_ones_ray_reads(own_tmp: str) -> None:
    """Each variable haproxy_env sets is one ray/serve/_private/constants.py reads."""
    from pdserve.cluster.serve_app import haproxy_env

    spec = importlib.util.find_spec("ray.serve._private.constants")
    if spec is None or spec.origin is None:
        pytest.skip("Ray Serve not installed")
    with open(spec.origin, encoding="utf-8") as f:
        source = f.read()
    for key in haproxy_env(_cfg([])):
        assert f'"{key}",' in source or f'"{key}")' in source, key


def test_init_ray_puts_the_ports_in_the_environment_before_ray_starts(monkeypatch: pytest.MonkeyPatch,
                                                                     own_tmp: str) -> None:
    import ray

    from pdserve.cluster import serve_app

    cfg = _cfg(MOVED)
    seen: dict[str, str] = {}
    for key in [*serve_app.haproxy_env(cfg), *serve_app.HAPROXY_ENV, *serve_app.LOCAL_ENV]:
        monkeypatch.setenv(key, "")  # restored (or removed again) after the test
        monkeypatch.delenv(key)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_METRICS_PORT", "9101")  # the flag wins over a variable
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(os.environ))
    serve_app.init_ray(cfg)
    for key, value in serve_app.haproxy_env(cfg).items():
        assert seen.get(key) == value, key
    assert seen["RAY_SERVE_ENABLE_HA_PROXY"] == "1"


@pytest.mark.parametrize("argv, name", [
    (["--haproxy-metrics-port", "0"], "haproxy_metrics_port"),
    (["--haproxy-stats-port", "70000"], "haproxy_stats_port"),
    (["--haproxy-metrics-port", "8000"], "haproxy_metrics_port"),
    (["--port", "9000", "--haproxy-stats-port", "9000"], "haproxy_stats_port"),
    (["--haproxy-metrics-port", "9000", "--haproxy-stats-port", "9000"], "haproxy_stats_port"),
    (["--haproxy-fallback-port", "8404"], "haproxy_fallback_port"),
    (["--haproxy-fallback-port", "-1"], "haproxy_fallback_port"),
])
def test_bad_or_clashing_ports_fail_naming_the_setting(argv: list[str], name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        _cfg(argv)


def test_clashing_haproxy_ports_are_fine_without_haproxy() -> None:
    assert _cfg(["--ingress", "proxy", "--haproxy-metrics-port", "8000"]).port == 8000


def test_the_haproxy_ports_no_flag_names_are_the_ones_that_may_move() -> None:
    from pdserve.cluster.serve_config import HAPROXY_PORTS

    assert _cfg([]).haproxy_ports_auto == frozenset(HAPROXY_PORTS)
    assert _cfg(["--haproxy-stats-port", "18404"]).haproxy_ports_auto == {"haproxy_metrics_port",
                                                                          "haproxy_fallback_port"}
    assert _cfg(MOVED).haproxy_ports_auto == frozenset()


@pytest.mark.parametrize("named", [False, True])
def test_a_haproxy_port_another_run_holds_moves_unless_it_was_named(named: bool,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A second `pdserve serve` on another --port met the first one's HAProxy on Ray's default
    metrics port (9101) and stopped with "port 9101 is in use". A port no flag named now moves to
    a free one, saying so; one the operator named stays, and check_ports names its holder."""
    import dataclasses

    from pdserve.cluster.leftovers import free_port, live_holder
    from pdserve.cluster.serve_app import bound_ports, settle_haproxy_ports

    with contextlib.closing(_listener()) as held:
        port = held.getsockname()[1]
        cfg = dataclasses.replace(_cfg(["--port", str(free_port())]), haproxy_metrics_port=port,
                                  haproxy_ports_auto=frozenset() if named else frozenset({"haproxy_metrics_port"}))
        assert live_holder(port) is not None  # this test's own process: no leftover
        settled = settle_haproxy_ports(cfg)
        if named:
            assert settled == cfg
            with pytest.raises(PortInUseError, match=f"port {port} is in use by pid {os.getpid()}.*"
                                                     "--haproxy-metrics-port"):
                check_ports({port: bound_ports(cfg)[port]})
            return
        moved = settled.haproxy_metrics_port
        assert moved != port and moved not in (cfg.port, cfg.haproxy_stats_port, cfg.haproxy_fallback_port)
        assert live_holder(moved) is None
        assert dataclasses.replace(settled, haproxy_metrics_port=port) == cfg  # nothing else moved for it
        err = capsys.readouterr().err
        assert f"port {port} (--haproxy-metrics-port's default) is in use by pid {os.getpid()}" in err
        assert f"takes {moved} instead" in err
        # The HTTP port itself held (a second start on the same --port): nothing moves, the preflight refuses it.
        with contextlib.closing(_listener()) as http:
            assert settle_haproxy_ports(dataclasses.replace(cfg, port=http.getsockname()[1])).haproxy_metrics_port \
                == port


def _listener() -> Any:
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s
