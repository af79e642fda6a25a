"""One local run per HTTP port (cluster/port_lock.py): a second run started on a port
another run is starting or serving on fails at once, naming that run; a run that died
(SIGKILL) blocks no one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from chaos.procs import free_port

from pdserve.cluster import port_lock
from pdserve.cluster.leftovers import PortInUseError

# Takes the lock for port argv[1] (in directory argv[2], or the default), says so, and waits.
HOLDER = ("import sys, time\n"
          "from pdserve.cluster import port_lock\n"
          "port_lock.hold(int(sys.argv[1]), directory=sys.argv[2] if len(sys.argv) > 2 else None)\n"
          "print('held', flush=True)\n"
          "time.sleep(120)\n")


def _holder(port: int, *directory: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(port), *directory], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def _end(proc: subprocess.Popen[str], sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def test_a_second_run_on_a_held_port_is_refused_naming_the_first(tmp_path: Path) -> None:
    first = _holder(8000, str(tmp_path))
    try:
        with pytest.raises(PortInUseError, match=rf"port 8000: another pdserve run \(pid {first.pid}\).*--port"):
            port_lock.hold(8000, directory=str(tmp_path))
        port_lock.hold(8001, directory=str(tmp_path))  # another port: its own lock
        port_lock.release(8001, directory=str(tmp_path))
    finally:
        _end(first)
    # Killed outright: the kernel let its lock go; the file it left is taken over.
    assert (tmp_path / "pdserve-port-8000.lock").exists()
    port_lock.hold(8000, directory=str(tmp_path))
    try:
        assert (tmp_path / "pdserve-port-8000.lock").read_text() == f"{os.getpid()}\n"
    finally:
        port_lock.release(8000, directory=str(tmp_path))
    assert not (tmp_path / "pdserve-port-8000.lock").exists()


def test_a_link_in_place_of_the_lock_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "target").write_text("keep")
    os.symlink(tmp_path / "target", tmp_path / "pdserve-port-8002.lock")
    with pytest.raises(PortInUseError, match="cannot take the run's lock"):
        port_lock.hold(8002, directory=str(tmp_path))
    assert (tmp_path / "target").read_text() == "keep"


@pytest.mark.slow
def test_pdserve_serve_on_a_port_another_run_holds_fails_at_once() -> None:
    """The whole CLI: exit 2 with one error line, before any Ray starts."""
    port = free_port()
    first = _holder(port)
    try:
        proc = subprocess.run([str(Path(sys.executable).with_name("pdserve")), "serve", "--model", "tiny",
                               "--port", str(port)], capture_output=True, text=True, timeout=120)
    finally:
        _end(first)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"pdserve: error: port {port}: another pdserve run (pid {first.pid})" in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout


def test_a_start_that_fails_lets_go_of_its_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """In process (a test, a library), a start that failed after its check kept the port's lock
    until the process ended: every later run on the port was refused (the suite's own did)."""
    from pdserve.cluster import serve_app
    from pdserve.cluster.serve_config import serve_config

    port = free_port()
    monkeypatch.setattr(serve_app, "starts_local_ray", lambda: True)
    monkeypatch.setattr(serve_app, "check_ports", lambda ports: [])

    def fails(*args: object) -> None:
        assert port_lock.lock_path(port) in port_lock._HELD  # held while it starts
        raise ValueError("model: no config.json")

    monkeypatch.setattr(serve_app, "_start_and_serve", fails)
    with pytest.raises(ValueError, match="config.json"):
        serve_app.run(serve_config({"model": "/m", "port": port}))
    assert port_lock.lock_path(port) not in port_lock._HELD
    second = _holder(port)  # another process takes it at once
    _end(second)


# `pdserve serve` through `cli.main` in a caller's process (a test, a library), with a driver that
# dies without a stop (SIGKILL, a crash: it never reaches `stop_ray`). Says the exit code (after
# whatever else it printed), then lives on until its stdin closes.
CALLER = ("import os, sys\n"
          "from pdserve.cluster import cli, serve_app, shutdown\n"
          "serve_app.starts_local_ray = lambda: True\n"
          "serve_app.check_ports = lambda ports: []\n"
          "cli._check_against_model = lambda cfg: None\n"
          "shutdown.run_until_stopped = lambda cfg: os._exit(9)\n"
          "print('exit', cli.main(['serve', '--model', 'tiny', '--port', sys.argv[1]]), flush=True)\n"
          "sys.stdin.read()\n")


def test_a_serve_whose_driver_died_lets_go_of_its_port_in_the_callers_process() -> None:
    """The caller's process took the port's lock before the fork (`_cmd_serve`'s preflight) and
    kept it after its driver was gone: every later run on the port, from any process, was refused
    naming the caller, until the caller exited; and the caller's own next run took no lock at all."""
    port = free_port()
    caller = subprocess.Popen([sys.executable, "-c", CALLER, str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None
        said = next(line for line in iter(caller.stdout.readline, "") if line.startswith("exit "))
        assert said == "exit 9\n"
        port_lock.hold(port)  # another run, the caller still alive
        port_lock.release(port)
    finally:
        assert caller.stdin is not None
        caller.stdin.close()
        caller.wait(30)
        assert caller.stdout is not None
        caller.stdout.close()


def test_a_release_leaves_a_lock_file_that_is_no_longer_its_own(tmp_path: Path) -> None:
    """`pdserve serve`'s driver (a fork holding the same lock) removes the file at its stop; a new
    run may then make it again and lock it. The caller's release must not remove that one."""
    path = port_lock.lock_path(8003, str(tmp_path))
    mine = port_lock.PortLock(path)
    os.unlink(path)  # what the driver's release did
    other = _holder(8003, str(tmp_path))  # the next run
    try:
        mine.release()
        assert os.path.exists(path)
        with pytest.raises(PortInUseError, match=rf"another pdserve run \(pid {other.pid}\)"):
            port_lock.hold(8003, directory=str(tmp_path))
    finally:
        _end(other)


# Takes the lock for port argv[1] in directory argv[2], names in it a process that is gone
# (argv[3]: as a run whose `pdserve serve` was killed names it while its driver stops), says
# so, and lets go after argv[4] seconds.
ORPHANED = ("import os, sys, time\n"
            "from pdserve.cluster import port_lock\n"
            "port_lock.hold(int(sys.argv[1]), directory=sys.argv[2])\n"
            "path = port_lock.lock_path(int(sys.argv[1]), sys.argv[2])\n"
            "with open(path, 'w') as f: f.write(sys.argv[3] + '\\n')\n"
            "print('held', flush=True)\n"
            "time.sleep(float(sys.argv[4]))\n")


def _gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    return proc.pid


def test_a_start_waits_for_a_killed_runs_driver_to_let_go(tmp_path: Path) -> None:
    # `pdserve serve` SIGKILLed: its driver still holds the lock while it stops (the lock names
    # the killed process). A start right after waited for nothing and failed (chaos scenario
    # (i1)); it now waits for the stop and takes the lock.
    import time

    proc = subprocess.Popen([sys.executable, "-c", ORPHANED, "8000", str(tmp_path), str(_gone_pid()), "1.0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        start = time.monotonic()
        port_lock.hold(8000, directory=str(tmp_path))
        try:
            assert time.monotonic() - start < port_lock.ORPHAN_STOP_WAIT_S
            assert (tmp_path / "pdserve-port-8000.lock").read_text() == f"{os.getpid()}\n"
        finally:
            port_lock.release(8000, directory=str(tmp_path))
    finally:
        _end(proc)


def test_a_killed_runs_driver_that_never_lets_go_is_refused_after_the_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(port_lock, "ORPHAN_STOP_WAIT_S", 0.5)
    gone = _gone_pid()
    proc = subprocess.Popen([sys.executable, "-c", ORPHANED, "8000", str(tmp_path), str(gone), "60"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        with pytest.raises(PortInUseError, match=rf"another pdserve run \(pid {gone}\)"):
            port_lock.hold(8000, directory=str(tmp_path))
    finally:
        _end(proc)
