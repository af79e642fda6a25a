"""What an earlier run left behind on the ports this run binds, found and cleared.

`pdserve serve` binds the HTTP port and, with Ray Serve's HAProxy ingress, the
HAProxy metrics and stats ports. A run stopped hard (SIGKILL, SIGTERM to its
process group while Ray was busy) can leave its HAProxy behind, orphaned, still
listening; the next run's HAProxy then dies on "Address already in use" and the
run never becomes healthy. `check_ports` runs before local Ray starts:

- a port held by such an orphan (a process named `haproxy` run with a config
  file from Ray Serve's HAProxy config directory, or from pdserve's per-run
  one, whose parent is gone: pid 1, or not a Ray process) is cleared: SIGTERM,
  then SIGKILL after a deadline, with one log line;
- a port held by anything else is a `PortInUseError` (a ValueError: `pdserve:
  error: ...`) naming the port, the holder's pid and command line, the command
  that clears it and the flag that moves the port. Nothing else is killed.

Linux only (it reads /proc: /proc/net/tcp{,6} for listening sockets, then
/proc/<pid>/fd for the process that holds one); elsewhere it checks nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Iterable, Mapping

logger = logging.getLogger(__name__)

# Ray Serve's default HAProxy directory (RAY_SERVE_HAPROXY_CONFIG_FILE_LOC's
# default, /tmp/haproxy-serve/haproxy.cfg, in ray/serve/_private/constants.py);
# its HAProxy runs as `<haproxy> -db -f <dir>/<node id>/haproxy.cfg [-dR] [-sf <pids>]`
# (ray/serve/_private/haproxy.py, HAProxyApi._start_and_wait_for_haproxy).
RAY_HAPROXY_DIR = "/tmp/haproxy-serve"
# pdserve's per-run HAProxy directory: haproxy_run_dir(http_port).
RUN_DIR_PREFIX = "pdserve-haproxy-"
_TCP_LISTEN = "0A"


class PortInUseError(ValueError):
    """A port this run binds is held by a process that is not a leftover of an
    earlier run (or that pdserve could not stop)."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """A process that has a listening socket open."""

    pid: int
    ppid: int
    cmdline: tuple[str, ...]

    @property
    def command(self) -> str:
        return " ".join(self.cmdline) or "?"


def haproxy_run_dir(http_port: int) -> str:
    """The directory of one run's HAProxy files (config, sockets, server state),
    named after the run's HTTP port: two runs on one machine never share files
    (Ray adds a directory per node under it)."""
    base = tempfile.gettempdir()
    # Unix socket paths are at most 107 bytes; Ray adds "/<56-hex node id>/metrics.sock".
    if len(base) > 30:
        base = "/tmp"
    return os.path.join(base, f"{RUN_DIR_PREFIX}{http_port}")


def port_released(port: int, wait_s: float = 5.0) -> bool:
    """Whether nothing listens on `port` (waited for up to `wait_s`: a stopped run's
    HAProxy can outlive Ray's stop by a moment)."""
    deadline = time.monotonic() + wait_s
    while listening_inodes(port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def remove_run_dir(http_port: int) -> bool:
    """Remove a stopped local run's HAProxy directory (haproxy_run_dir): each run on a
    port of its own (the tests', the benchmarks') would otherwise leave one in /tmp.
    Call it once the run's port is released (`port_released`): while a run listens
    there, its HAProxy may be using the directory. Only this user's own directory is
    removed (never what a link points to). Returns whether it is gone."""
    path = haproxy_run_dir(http_port)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def listening_inodes(port: int) -> set[int]:
    """Inodes of the TCP sockets listening on `port` (any address, IPv4 or IPv6)."""
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _TCP_LISTEN:
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] != "0":
                inodes.add(int(fields[9]))
    return inodes


def socket_holders(inodes: Iterable[int]) -> list[Holder]:
    """The processes (that this user may look at) with one of these sockets open."""
    wanted = {f"socket:[{i}]" for i in inodes}
    holders: list[Holder] = []
    if not wanted:
        return holders
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link in wanted:
                holder = process(pid)
                if holder is not None:
                    holders.append(holder)
                break
    return holders


def process(pid: int) -> Holder | None:
    """`pid`'s parent and command line, or None when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as fb:
            raw = fb.read()
    except (OSError, IndexError):
        return None
    if after_name[0] in ("Z", "X"):
        return None
    args = tuple(a.decode(errors="replace") for a in raw.split(b"\0") if a)
    return Holder(pid=pid, ppid=int(after_name[1]), cmdline=args)


def is_ray_haproxy(cmdline: tuple[str, ...]) -> bool:
    """Whether `cmdline` is a Ray Serve HAProxy: `haproxy ... -f <config>` with its
    config under Ray Serve's HAProxy directory or a pdserve per-run one."""
    if not cmdline or os.path.basename(cmdline[0]) != "haproxy":
        return False
    configs = [cmdline[i + 1] for i, a in enumerate(cmdline[:-1]) if a == "-f"]
    return any(_in_haproxy_dir(c) for c in configs)


def _in_haproxy_dir(config: str) -> bool:
    path = os.path.normpath(config)
    if os.path.basename(path) != "haproxy.cfg":
        return False
    roots = [RAY_HAPROXY_DIR]
    parts = path.split(os.sep)
    roots += [os.sep.join(parts[:i + 1]) for i, p in enumerate(parts) if p.startswith(RUN_DIR_PREFIX)
              and p[len(RUN_DIR_PREFIX):].isdigit()]
    return any(path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def is_orphan(holder: Holder) -> bool:
    """Whether `holder`'s parent is gone: reparented to pid 1 (or to a subreaper,
    which is no Ray process); a live Ray Serve's HAProxy has its HAProxy manager
    actor (a Ray worker process) as parent."""
    if holder.ppid <= 1:
        return True
    parent = process(holder.ppid)
    return parent is None or not _is_ray_process(parent.cmdline)


def _is_ray_process(cmdline: tuple[str, ...]) -> bool:
    if not cmdline:
        return False
    if cmdline[0].startswith("ray::"):  # a Ray worker, as setproctitle names it
        return True
    return any(os.path.basename(a) in ("default_worker.py", "raylet", "gcs_server") for a in cmdline)


def is_leftover(holder: Holder) -> bool:
    """An orphaned Ray Serve HAProxy: safe to stop."""
    return is_ray_haproxy(holder.cmdline) and is_orphan(holder)


def live_holder(port: int) -> str | None:
    """Who holds `port` other than an earlier run's orphan (which `check_ports` clears): its pid
    and command line, or that pdserve cannot see it; None when nothing else listens there."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    inodes = listening_inodes(port)
    if not inodes:
        return None
    holders = socket_holders(inodes)
    if not holders:
        return "a process pdserve cannot see"
    others = [h for h in holders if not is_leftover(h)]
    if not others:
        return None
    h = others[0]
    return f"pid {h.pid} ({os.path.basename(h.cmdline[0]) if h.cmdline else '?'})"


def free_port(avoid: Iterable[int] = ()) -> int:
    """A TCP port free on every address of this machine now (the kernel's pick), none of `avoid`."""
    avoid = set(avoid)
    for _ in range(64):  # the kernel picks among ~28k ephemeral ports: a few to avoid are rarely picked twice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port
    raise OSError(f"no free port outside {sorted(avoid)}")


def check_ports(ports: Mapping[int, str], timeout_s: float = 5.0) -> list[int]:
    """Clear the ports this run binds (port -> the flag that moves it) of an
    earlier run's orphaned HAProxy; raise PortInUseError naming any other holder.
    Returns the pids stopped."""
    stopped: list[int] = []
    if not os.path.isdir("/proc/self/fd"):
        return stopped
    for port, flag in ports.items():
        for _ in range(3):  # a holder stopped may leave another (an HAProxy draining after a reload)
            inodes = listening_inodes(port)
            if not inodes:
                break
            holders = socket_holders(inodes)
            if not holders:
                raise PortInUseError(
                    f"port {port} is in use by a process pdserve cannot see (another user's?); find it with "
                    f"`sudo ss -ltnp 'sport = :{port}'` and stop it, or move the port with {flag}")
            others = [h for h in holders if not is_leftover(h)]
            if others:
                h = others[0]
                advice = (f", the HAProxy of a Ray Serve still running; stop that run (or `kill {h.pid}`),"
                          if is_ray_haproxy(h.cmdline) else f"; stop it (`kill {h.pid}`)")
                raise PortInUseError(f"port {port} is in use by pid {h.pid} ({h.command}){advice} "
                                     f"or move the port with {flag}")
            for h in holders:
                logger.warning("pdserve: stopping pid %d, an orphaned Ray Serve HAProxy of an earlier run holding "
                               "port %d (%s)", h.pid, port, h.command)
                stop(h, timeout_s)
                stopped.append(h.pid)
            # The listener can outlive its holders for a moment (seen between two runs: no
            # process held it any more, the kernel still listed it); wait for it to go
            # before taking what is left for another user's process. A holder that shows
            # (an HAProxy draining after a reload) ends the wait: the next pass takes it.
            if _released(port, timeout_s):
                break
        else:
            if listening_inodes(port):
                raise PortInUseError(f"port {port} is still in use after stopping pids {stopped}; "
                                     f"move the port with {flag}")
    return stopped


def _released(port: int, timeout_s: float) -> bool:
    """Whether nothing listens on `port` any more, within `timeout_s`; False at once when
    a process is seen holding it."""
    deadline = time.monotonic() + timeout_s
    while inodes := listening_inodes(port):
        if time.monotonic() >= deadline or socket_holders(inodes):
            return False
        time.sleep(0.05)
    return True


def stop(holder: Holder, timeout_s: float = 5.0) -> None:
    """SIGTERM `holder`, SIGKILL it if it outlives `timeout_s`; returns once it is
    gone (raises PortInUseError if even SIGKILL does not end it)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        now = process(holder.pid)
        if now is None or now.cmdline != holder.cmdline:  # gone, or the pid is another process's now
            return
        try:
            os.kill(holder.pid, sig)
        except ProcessLookupError:
            return
        except PermissionError as e:
            raise PortInUseError(f"cannot stop pid {holder.pid} ({holder.command}): {e.strerror}") from None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process(holder.pid) is None:
                return
            time.sleep(0.02)
    raise PortInUseError(f"pid {holder.pid} ({holder.command}) did not exit after SIGKILL")
