"""A real `pdserve serve` for tests that need one as its own process (a stop by signal, the
docs' commands): started in a session of its own so that a signal to its group reaches only
what the test started; what it runs is found by pid (with its start time) among its
descendants and every session they made, and whatever the test leaves is killed by pid."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from chaos.procs import free_port

from pdserve.cluster.leftovers import port_released, remove_run_dir
from pdserve.cluster.port_lock import lock_path
from pdserve.workers.cpu_turns import remove_node_files

PDSERVE = str(Path(sys.executable).with_name("pdserve"))
START_TIMEOUT_S = 420.0  # a cold start on a 2-core machine other jobs kept busy took 133 s


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on every address of this machine, outside the ranges the kernel
    and Ray hand out themselves (chaos/procs.py `free_port`): a port bind(0) found free could be
    any connection's source port before a server binds it (HAProxy once found one taken in CI)."""
    found: set[int] = set()
    while len(found) < n:
        found.add(free_port())
    return sorted(found)


def proc_table() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, session, start time in ticks) of every live process (zombies are not)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in (b"Z", b"X"):
            table[int(entry)] = (int(fields[1]), int(fields[3]), int(fields[19]))
    return table


def tree(root: int) -> dict[int, int]:
    """pid -> start time of `root`, its live descendants, and every process in their sessions."""
    table = proc_table()
    found, todo = {root}, [root]
    while todo:
        pid = todo.pop()
        kids = [p for p, (ppid, _, _) in table.items() if ppid == pid and p not in found]
        found.update(kids)
        todo.extend(kids)
    sessions = {table[p][1] for p in found if p in table}
    return {p: start for p, (_, sid, start) in table.items() if p in found or sid in sessions}


def alive(procs: dict[int, int]) -> dict[int, int]:
    """Those of `procs` (pid -> start time) still running, a reused pid aside."""
    table = proc_table()
    return {pid: start for pid, start in procs.items() if table.get(pid, (0, 0, -1))[2] == start}


class Server:
    """`pdserve serve ARGS` with its port and HAProxy's moved to free ones; `start` returns at
    once, `wait_ready` when it serves."""

    def __init__(self, args: list[str], stderr_path: Path) -> None:
        port, metrics, stats, fallback = free_ports(4)
        self.port = port
        self.url = f"http://127.0.0.1:{port}/v1"
        self.argv = [PDSERVE, "serve", *args, "--port", str(port), "--haproxy-metrics-port", str(metrics),
                     "--haproxy-stats-port", str(stats), "--haproxy-fallback-port", str(fallback)]
        self.stderr_path = stderr_path
        self.stdout: list[str] = []
        self.started: dict[int, int] = {}  # once it serves: pid -> start time of all it runs
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> Server:
        with open(self.stderr_path, "w", encoding="utf-8") as err:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=err, text=True,
                                         start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> Server:
        if not self.started:
            self._read_until("[pdserve] serving", timeout_s)
            assert self.proc is not None
            self.started = tree(self.proc.pid)
        return self

    def stderr(self) -> str:
        return self.stderr_path.read_text(encoding="utf-8")

    def _read_until(self, marker: str, timeout_s: float) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"pdserve serve exited ({self.proc.wait()}) before serving:\n"
                                     f"{self.stderr()[-3000:]}")
            self.stdout.append(line)
            if line.startswith(marker):
                return
        raise AssertionError(f"pdserve serve did not serve within {timeout_s:g} s:\n{self.stderr()[-3000:]}")

    def kill(self) -> None:
        """Kill by pid whatever of it still runs (what the test did not stop)."""
        if self.proc is None:
            return
        left = alive({**self.started, **(tree(self.proc.pid) if self.proc.poll() is None else {})})
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if left and port_released(self.port):  # killed: its stop never removed its files
            remove_run_dir(self.port)
            remove_node_files(f"pdserve-{self.port}")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path(self.port))  # (no lock on it: its holder is dead)
