"""A stop is a stop: SIGTERM or SIGINT to `pdserve serve`'s process or to its process group
(what systemd, Kubernetes and Ctrl-C send) ends it with exit 0 and one line, no traceback
and no crash report, and nothing it started left running (cluster/shutdown.py).

Each case starts a real `pdserve serve --model tiny` in a session of the test's own, so that
the group signal reaches only what the test started; leftovers are looked for by pid (with
its start time) among its descendants and every session they made (tests/served.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from served import Server, alive, tree

from pdserve.cluster.leftovers import haproxy_run_dir
from pdserve.cluster.port_lock import lock_path
from pdserve.workers.cpu_turns import lending_dir, turns_path

STOP_TIMEOUT_S = 60.0  # past the stop's own bound (shutdown.STOP_DEADLINE_S), so that one is what fires

# SIGTERM to the group (systemd's default KillMode=control-group) takes the path of these two: the
# supervisor stops the driver alike for either signal, to it alone or to its group (the stand-in
# driver's cases below check each signal and group in seconds), so a third real server is not run.
CASES = {
    "SIGTERM-process": (signal.SIGTERM, False),  # `kill PID`, a container's stop; systemd's KillMode=mixed
    "SIGINT-group": (signal.SIGINT, True),  # Ctrl-C in the terminal that runs it
}


def assert_stopped_cleanly(server: Server, sig: signal.Signals) -> None:
    """Exit 0, one stop line naming the signal, no crash in its output, nothing left running."""
    assert server.proc is not None and server.proc.stdout is not None
    code = server.proc.wait(STOP_TIMEOUT_S)
    out = "".join(server.stdout) + server.proc.stdout.read()
    err = server.stderr()
    assert code == 0, err[-3000:]
    stops = [line for line in err.splitlines() if line.startswith("[pdserve] stop")]
    assert len(stops) == 1 and stops[0].startswith(f"[pdserve] stopped on {sig.name}:"), stops
    for crash in ("Traceback", "Aborted", f"{sig.name} received", "Check failed", "core dumped"):
        assert crash not in err and crash not in out, (crash, err[-3000:])
    left = alive(server.started)
    assert not left, {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in left}
    # Nor its files: the HAProxy directory in /tmp, the CPU workers' in /dev/shm (each run on a
    # port of its own left them).
    app = f"pdserve-{server.port}"
    left_files = [p for p in (haproxy_run_dir(server.port), lending_dir(app), turns_path(app), lock_path(server.port))
                  if os.path.lexists(p)]
    assert not left_files, left_files


class Stream(threading.Thread):
    """A streamed completion of MAX_TOKENS tokens; `started` once its first chunk is in."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.started = url, threading.Event()
        self.finish_reason: str | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.started.set()
                        self.finish_reason = json.loads(line[6:])["choices"][0]["finish_reason"] or self.finish_reason
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.started.set()


# About 2 s of the tiny model's decoding (~300 tokens/s on a loaded 2-core machine): in flight
# when the signal comes, done well within the drain's bound (shutdown.DRAIN_S).
MAX_TOKENS = 600

# A KV pool of 256 blocks (4096 tokens: the stream's 600 and two of the tiny model's 2048-token
# contexts), not the CPU default's 4 GiB per worker: touching 2 x 4 GiB at start-up (huge pages the
# kernel compacts and zeroes) took seconds of the 2 cores' time per start, and what is tested here
# is the stop, which the pool's size does not change.
SMALL_POOL = ["--num-kv-blocks", "256"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_signal_stops_the_server_cleanly(case: str, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    sig, to_group = CASES[case]
    server = Server(["--model", "tiny", *SMALL_POOL], tmp_path / "stderr.txt")
    try:
        server.start().wait_ready()
        assert server.proc is not None
        # The driver, Ray's processes, the workers, HAProxy: the tree is seen.
        assert len(server.started) > 5, server.started
        stream = Stream(server.url)
        stream.start()
        assert stream.started.wait(60) and stream.error is None, stream.error
        assert stream.is_alive()  # in flight
        (os.killpg if to_group else os.kill)(server.proc.pid, sig)
        assert_stopped_cleanly(server, sig)
        stream.join(10)
        # The request in flight at the signal finished (a stop drains; it used to be cut short).
        assert stream.error is None and stream.finish_reason == "length", (stream.error, stream.finish_reason)
    finally:
        server.kill()


# -- the supervisor alone (cluster/shutdown.py), with a stand-in for the driver: seconds, no Ray -------------

# A driver that starts a process of its own (as Ray's would be, in the driver's group) and,
# told to stop, exits with EXIT, leaving that process behind, or ignores the stop (IGNORE).
DRIVER = textwrap.dedent("""
    import importlib.util, os, signal, subprocess, sys, time

    # The module by its path: importing the pdserve package (torch) would take longer than the test.
    spec = importlib.util.spec_from_file_location("shutdown", sys.argv[3])
    shutdown = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shutdown)
    shutdown.STOP_DEADLINE_S = 2.0
    exit_code, ignore = int(sys.argv[1]), sys.argv[2] == "ignore"

    def serve():
        if ignore:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        # The pid is printed inside the try: the test stops it as soon as it reads the pid, and a
        # stop that landed between the print and the try would end the driver with exit 1.
        try:
            helper = subprocess.Popen(["sleep", "60"])
            print(helper.pid, flush=True)
            time.sleep(60 if exit_code == 0 or ignore else 1)
        except KeyboardInterrupt:
            pass
        os._exit(exit_code)

    sys.exit(shutdown.serve_in_own_group(serve))
""")


def supervised(exit_code: int, ignore: bool = False, inherited: str = "plain") -> tuple[subprocess.Popen[str], int]:
    """The supervisor and its stand-in driver. `inherited`: "blocked", started with SIGINT and
    SIGTERM blocked; "sigint-ignored", with SIGINT ignored (what a command run in the background of
    a non-interactive shell gets); "plain", neither."""
    module = Path(__file__).resolve().parents[2] / "cluster" / "shutdown.py"

    def inherit() -> None:
        if inherited == "blocked":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        elif inherited == "sigint-ignored":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        else:  # whatever this test process has, not passed on
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, set())

    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(exit_code), "ignore" if ignore else "stop", str(module)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=inherit)
    assert proc.stdout is not None
    helper = int(proc.stdout.readline())
    return proc, helper


@pytest.mark.parametrize("inherited", ["plain", "blocked", "sigint-ignored"])
def test_a_group_sigterm_reaches_the_parent_alone_and_what_the_driver_left_is_stopped(inherited: str) -> None:
    """Also when the supervisor inherits SIGINT and SIGTERM blocked, or SIGINT ignored (a suite
    run in the background of a script: it ran into the stop's deadline, exit 1): its driver must
    still hear the SIGINT that stops it."""
    proc, helper = supervised(0, inherited=inherited)
    started = tree(proc.pid)
    assert helper in started and len(started) == 3  # parent, driver, its process
    # In a group of the driver's own, in the caller's session (where tests/chaos looks for them).
    assert os.getpgid(helper) != proc.pid and os.getsid(helper) == proc.pid
    os.killpg(proc.pid, signal.SIGTERM)
    rc = proc.wait(20)
    _, err = proc.communicate()
    assert rc == 0, err
    assert err.startswith("[pdserve] stopped on SIGTERM:") and "1 process(es) it left stopped by pid" in err, err
    assert len(err.splitlines()) == 1
    assert not alive(started)


def test_a_driver_that_does_not_stop_is_killed_at_the_deadline() -> None:
    proc, helper = supervised(0, ignore=True)
    started = tree(proc.pid)
    t = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(20) == 1
    assert 2.0 <= time.monotonic() - t
    _, err = proc.communicate()
    assert err.startswith("[pdserve] stop on SIGINT took over 2 s: killed 2 process(es)"), err
    assert not alive(started)


def test_a_driver_that_exits_on_its_own_gives_its_exit_code() -> None:
    proc, helper = supervised(3)
    left = {helper: tree(helper)[helper]}
    assert proc.wait(20) == 3
    _, err = proc.communicate()
    assert err == ""  # no stop was asked for: no stop line
    assert not alive(left)  # what it left is stopped all the same


# A process that starts `sleep` again whenever it dies, and goes on doing so for a while after a
# SIGTERM, as Serve's HAProxy manager starts its HAProxy again (cluster/haproxy_guard.py); the pid of
# every `sleep` it starts goes to the file argv[1].
RESPAWNER = textwrap.dedent("""
    import signal, subprocess, sys, time

    told = []
    signal.signal(signal.SIGTERM, lambda *_: told.append(time.monotonic()))
    child = None
    while not told or time.monotonic() - told[0] < 0.5:
        if child is None or child.poll() is not None:
            child = subprocess.Popen(["sleep", "60"])
            with open(sys.argv[1], "a") as f:
                print(child.pid, file=f, flush=True)
        time.sleep(0.02)
""")

RESPAWNING_DRIVER = textwrap.dedent("""
    import importlib.util, subprocess, sys, time

    spec = importlib.util.spec_from_file_location("shutdown", sys.argv[1])
    shutdown = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shutdown)

    def serve():
        subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[3]])
        try:
            print("serving", flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            pass
        return 0

    sys.exit(shutdown.serve_in_own_group(serve))
""")


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def test_a_process_started_while_the_sweep_stops_its_parent_is_stopped_too(tmp_path: Path) -> None:
    """The sweep after the driver signalled a process and its child at once; the child died first
    and the parent started another before it went (Serve's HAProxy manager does, within 0.1 s). That
    one was in no list, and outlived the stop (an orphan HAProxy on the port, once in chaos (p))."""
    module = Path(__file__).resolve().parents[2] / "cluster" / "shutdown.py"
    pids = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-c", RESPAWNING_DRIVER, str(module), RESPAWNER, str(pids)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "serving\n"
        deadline = time.monotonic() + 10
        while not (pids.exists() and pids.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0, proc.communicate()[1]
        started = [int(line) for line in pids.read_text().split()]
        assert len(started) >= 2, started  # the first `sleep`, and one started while the sweep ran
        assert not [pid for pid in started if _running(pid)]
    finally:
        for pid in [int(line) for line in pids.read_text().split()] if pids.exists() else []:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# A driver that starts a process of its own and returns when stopped (or, "ignore", never stops).
ORPHANED_DRIVER = textwrap.dedent("""
    import importlib.util, signal, subprocess, sys, time

    spec = importlib.util.spec_from_file_location("shutdown", sys.argv[2])
    shutdown = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shutdown)
    shutdown.STOP_DEADLINE_S = 2.0
    shutdown.SWEEP_GRACE_S = 1.0

    def serve():
        if sys.argv[1] == "ignore":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        helper = subprocess.Popen(["sleep", "60"])
        try:
            print(helper.pid, flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            pass
        return 0

    sys.exit(shutdown.serve_in_own_group(serve))
""")


@pytest.mark.parametrize("driver", ["stops", "ignore"])
def test_a_supervisor_killed_outright_leaves_nothing_running(driver: str) -> None:
    """SIGKILL to `pdserve serve`'s own process (the OOM killer, `kill -9`): the driver hears it
    (PR_SET_PDEATHSIG) and stops, but no one bounded that stop or swept what it left. The
    driver does both now: what it started is stopped, and a stop that hangs ends at the deadline."""
    module = Path(__file__).resolve().parents[2] / "cluster" / "shutdown.py"
    proc = subprocess.Popen([sys.executable, "-c", ORPHANED_DRIVER, driver, str(module)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    helper = int(proc.stdout.readline())
    started = tree(proc.pid)
    try:
        assert helper in started and len(started) == 3  # the supervisor, the driver, its process
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10  # the stop's 2 s, a second's poll, the sweep's grace
        while alive(started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(started), alive(started)
    finally:
        for pid in alive(started):
            os.kill(pid, signal.SIGKILL)
        proc.communicate()


# A driver whose shutdown ends just inside the deadline and leaves a process that ignores
# SIGTERM (a Ray daemon, HAProxy under load): the sweep must fit in what is left of the deadline.
SLOW_DRIVER = textwrap.dedent("""
    import importlib.util, signal, subprocess, sys, time

    spec = importlib.util.spec_from_file_location("shutdown", sys.argv[1])
    shutdown = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shutdown)
    shutdown.STOP_DEADLINE_S = 2.0

    def serve():
        helper = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                   "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
        try:
            print(helper.pid, flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            time.sleep(1.8)  # Serve's and Ray's shutdown, just inside the deadline
        return 0

    sys.exit(shutdown.serve_in_own_group(serve))
""")


def test_the_whole_stop_ends_within_its_deadline() -> None:
    """The sweep's grace came on top of the deadline: 2 s plus 3 (28 + 3 = 31 s for real, past
    Kubernetes' 30 s grace, whose SIGKILL would orphan what the sweep had only signalled)."""
    module = Path(__file__).resolve().parents[2] / "cluster" / "shutdown.py"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_DRIVER, str(module)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    helper = int(proc.stdout.readline())
    started = tree(proc.pid)
    t = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(20)
    took = time.monotonic() - t
    proc.communicate()
    assert took < 2.6, f"the stop took {took:.1f} s against a 2 s deadline"
    assert helper in started and not alive(started)


# A caller with a child of its own calls the supervisor in-process (as tests call `cli.main`):
# the driver fails at once; the caller goes on once (the forked driver never returns into its
# code), with the CLI's exit code 2, and its own child is neither reaped nor stopped.
CALLER = textwrap.dedent("""
    import importlib.util, subprocess, sys

    spec = importlib.util.spec_from_file_location("shutdown", sys.argv[1])
    shutdown = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shutdown)
    mine = subprocess.Popen(["sleep", "60"])

    def serve():
        raise ValueError("port 1: in use")

    code = shutdown.serve_in_own_group(serve)
    print(f"after {code} {mine.poll()}", flush=True)
    mine.kill()
""")


def test_a_caller_in_process_goes_on_once_and_keeps_its_own_children() -> None:
    module = Path(__file__).resolve().parents[2] / "cluster" / "shutdown.py"
    proc = subprocess.run([sys.executable, "-c", CALLER, str(module)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["after 2 None"], proc.stdout
    assert proc.stderr.strip() == "pdserve: error: port 1: in use", proc.stderr
