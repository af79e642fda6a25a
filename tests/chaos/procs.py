"""What the chaos harness reads of the processes it started, from /proc: alive or
stopped, their session, command line and start time, their loopback TCP connections
(and `cut_links`, which cuts them: `ss -K`, root), and a free port for a server.
Linux only; 127.0.0.1 only."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
from collections.abc import Iterable, Sequence


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first), or None when gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP)."""
    st = _stat(pid)
    return st is not None and st[0] == "T"


def session_of(pid: int) -> int | None:
    st = _stat(pid)
    return int(st[3]) if st is not None else None


def session_members(sid: int) -> list[int]:
    """Live processes of session `sid`."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            pid = int(entry.name)
            st = _stat(pid)
            if st is not None and int(st[3]) == sid and st[0] not in ("Z", "X"):
                pids.append(pid)
    return sorted(pids)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
    except OSError:
        return ""


def process_start(pid: int) -> float | None:
    """When `pid` started (Unix time), or None when gone."""
    st = _stat(pid)
    if st is None:
        return None
    with open("/proc/stat", encoding="ascii") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    return btime + int(st[19]) / os.sysconf("SC_CLK_TCK")


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
    return inodes


def _tcp4() -> list[tuple[str, int, str, int, str, int]]:
    """/proc/net/tcp rows: (local ip hex, local port, remote ip hex, remote port, state, inode)."""
    rows = []
    with open("/proc/net/tcp", encoding="ascii") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            (lip, lport), (rip, rport) = fields[1].split(":"), fields[2].split(":")
            rows.append((lip, int(lport, 16), rip, int(rport, 16), fields[3], int(fields[9])))
    return rows


_LOOPBACK, _LISTEN, _ESTABLISHED = "0100007F", "0A", "01"


def loopback_ports(pid: int) -> set[int]:
    """The ports `pid` listens on at 127.0.0.1 (pdserve's own sockets: a decode worker's
    KV receiver, a gateway's token-stream collector and HTTP server; Ray listens elsewhere)."""
    mine = _socket_inodes(pid)
    return {lport for lip, lport, _, _, st, ino in _tcp4() if st == _LISTEN and lip == _LOOPBACK and ino in mine}


def links(client: int, server: int, ports: Iterable[int] | None = None) -> list[tuple[int, int]]:
    """(client port, server port) of the TCP connections `client` opened to a
    127.0.0.1 port `server` listens on (`ports`, when given, narrows them)."""
    wanted = set(ports) if ports is not None else loopback_ports(server)
    mine = _socket_inodes(client)
    return sorted((lport, rport) for lip, lport, rip, rport, st, ino in _tcp4()
                  if st == _ESTABLISHED and ino in mine and rip == _LOOPBACK and rport in wanted)


def can_cut_links() -> bool:
    """`ss -K` needs root and a kernel with INET_DIAG_DESTROY."""
    return shutil.which("ss") is not None and os.geteuid() == 0


def cut_links(conns: Sequence[tuple[int, int]]) -> int:
    """Destroy these loopback TCP connections, both ends (`ss -K`: the sockets are
    closed under their owners, as a dropped link would be). Returns how many of the
    connections are gone afterwards."""
    for lport, rport in conns:
        flt = f"( sport = :{lport} and dport = :{rport} ) or ( sport = :{rport} and dport = :{lport} )"
        subprocess.run(["ss", "-K", "-t", "state", "established", flt], capture_output=True, timeout=10, check=False)
    live = {(lp, rp) for _, lp, _, rp, st, _ in _tcp4() if st == _ESTABLISHED}
    return sum((lp, rp) not in live for lp, rp in conns)


# Ports the harness hands to servers it starts later: below Linux's ephemeral range (32768-60999,
# where the kernel picks ports for Ray's own listeners and every outgoing connection) and above
# Ray's worker ports (10002-19999), so nothing can be given the port between this check and its use.
_PORTS = range(20000, 32768)


def free_port() -> int:
    """A port free on every address of this machine (HAProxy binds 0.0.0.0; Ray listens on the
    node's address), outside the ranges the kernel and Ray assign on their own."""
    for _ in range(1000):
        port = random.choice(_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1}")
