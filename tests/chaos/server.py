"""The chaos harness's server: `pdserve serve` as a subprocess in a session of its own (every
Ray process it starts stays in that session, so the harness can tell them from any other
process on the machine, and stops only those), on free ports, with PDSERVE_FAULT_INJECTION=1
in its environment (which its Ray workers inherit); what it counts of faults (GET /metrics)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from chaos.load import EXACT_DTYPE
from chaos.procs import (
    alive,
    cmdline,
    free_port,
    session_members,
    session_of,
)
from pdserve.workers.fault_seam import FAULT_INJECTION_ENV

NAMESPACE = "pdserve"  # cluster/serve_app.py's (not imported: that pulls Ray Serve into every user of this module)
GATEWAY_DEPLOYMENT = "pdserve-gateway"  # cluster/serve_app.py's
GATEWAY_TITLE = f"ray::ServeReplica:{NAMESPACE}:{GATEWAY_DEPLOYMENT}"  # a gateway replica's process title




# What the cluster says it did about a fault (GET /metrics; docs/observability.md).
COUNTERS = {
    "pdserve:request_migrations": "migrations",
    "pdserve:request_migrations_exhausted": "migrations exhausted",
    "pdserve:token_stream_gaps": "token-stream gaps",
    "pdserve:kv_transfer_failures": "KV transfer failures",
    "pdserve:kv_links_lost": "KV links lost",
    "pdserve:kv_link_resyncs": "KV link resyncs",
    "pdserve:kv_leases_expired": "KV leases expired",
    "pdserve:orphan_requests_aborted": "orphans aborted",
    "pdserve:workers_restarted": "workers restarted",
    "pdserve:requests_faulted": "requests failed alone",
}




@dataclass(frozen=True)
class ServerOptions:
    """How the harness runs `pdserve serve` (flags beyond these go in `extra`)."""

    model: str
    dtype: str = EXACT_DTYPE
    prefill: int = 1
    decode: int = 2
    colocated: int = 0  # > 0: `--mode colocated` with this many workers (prefill and decode unused)
    ingress: str = "haproxy"
    max_model_len: int = 2048
    # A request's deadline at the gateway: it bounds how long a request may take
    # before the server must end it itself (a client read past it is a hang).
    request_timeout: float = 60.0
    extra: tuple[str, ...] = ()

    def worker_names(self) -> list[str]:
        if self.colocated:
            return [f"pdserve-worker-{i}" for i in range(self.colocated)]
        return self.prefill_names() + self.decode_names()

    def prefill_names(self) -> list[str]:
        return [] if self.colocated else [f"pdserve-prefill-{i}" for i in range(self.prefill)]

    def decode_names(self) -> list[str]:
        return [] if self.colocated else [f"pdserve-decode-{i}" for i in range(self.decode)]

    def pool_args(self) -> list[str]:
        if self.colocated:
            return ["--mode", "colocated", "--workers", str(self.colocated)]
        return ["--prefill", str(self.prefill), "--decode", str(self.decode)]


@dataclass(frozen=True)
class Ports:
    http: int
    metrics: int
    stats: int
    fallback: int

    @classmethod
    def free(cls) -> Ports:
        ports: set[int] = set()
        while len(ports) < 4:
            ports.add(free_port())
        return cls(*sorted(ports))


def pdserve_command() -> list[str]:
    """`pdserve` of this Python environment (the script beside the interpreter), or
    the same entry point through `python -c` where it is not installed."""
    script = Path(sys.executable).with_name("pdserve")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from pdserve.cluster.cli import main; sys.exit(main())"]


class Server:
    """`pdserve serve` in a session of its own; `stop` ends it and everything it started."""

    def __init__(self, opts: ServerOptions, log_dir: Path, ports: Ports | None = None) -> None:
        self.opts, self.log_dir = opts, log_dir
        self.ports = ports or Ports.free()
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0  # time.monotonic() of the last start
        self.startup_s: float | None = None  # start -> /health 200 "ok", of the last start
        self.sid = 0
        self.old_sids: list[int] = []  # sessions of earlier starts (killed ones)
        self.log_path = log_dir / "serve.log"
        self._frozen: set[int] = set()  # pids this harness stopped (SIGSTOP) and has not continued

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"

    def command(self) -> list[str]:
        o, p = self.opts, self.ports
        return [*pdserve_command(), "serve", "--model", o.model, *o.pool_args(),
                "--ingress", o.ingress, "--port", str(p.http), "--haproxy-metrics-port", str(p.metrics),
                "--haproxy-stats-port", str(p.stats), "--haproxy-fallback-port", str(p.fallback),
                "--max-model-len", str(o.max_model_len), "--request-timeout", f"{o.request_timeout:g}",
                "--dtype", o.dtype,
                # Lending, which `auto` gives any real model (cluster/placement.py), not the split
                # that `auto` picks for the matrix's tiny model: the kills must meet the locks.
                "--cpu-sharing", "lend", *o.extra]

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env[FAULT_INJECTION_ENV] = "1"  # inject_fault on: the Ray workers inherit it from the process that starts Ray
        env.setdefault("RAY_AUTH_MODE", "token")  # local Ray's default, spelled out: RayView joins with it
        env.pop("RAY_ADDRESS", None)
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, cwd=self.log_dir, start_new_session=True)
        self.sid = self.proc.pid
        self.started_at = time.monotonic()
        self.startup_s = None

    def restart(self) -> None:
        """Start `pdserve serve` again on the same ports (after the last one was killed);
        what is left of the old one's session is reaped by `stop`."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("pdserve serve is still running")
        self.old_sids.append(self.sid)
        self.start()

    def health(self, timeout_s: float = 2.0) -> tuple[int, dict[str, Any]] | None:
        """(status, body) of GET /health, or None when nothing answers."""
        try:
            r = httpx.get(f"{self.url}/health", timeout=timeout_s, trust_env=False)
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            return r.status_code, body
        except (httpx.HTTPError, ValueError):
            return None

    def counters(self, timeout_s: float = 5.0) -> dict[str, float]:
        """COUNTERS from GET /metrics (the gateway's and every worker's), summed over
        their labels; {} when it does not answer."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            r = httpx.get(f"{self.url}/metrics", timeout=timeout_s, trust_env=False)
            r.raise_for_status()
        except httpx.HTTPError:
            return {}
        out = dict.fromkeys(COUNTERS, 0.0)
        for fam in text_string_to_metric_families(r.text):
            for sample in fam.samples:
                name = sample.name.removesuffix("_total")
                if name in out:
                    out[name] += sample.value
        return out

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds from `start` to /health 200 "ok" from this start's gateway (not one an
        earlier, killed start left answering for a moment); RuntimeError with the log's
        tail if the server exits or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"pdserve serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            h = self.health() if self.gateway_pid() is not None else None
            if h is not None and h[0] == 200 and h[1].get("status") == "ok":
                self.startup_s = time.monotonic() - self.started_at
                return self.startup_s
            time.sleep(0.25)
        raise RuntimeError(f"pdserve serve not healthy within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def pids(self) -> list[int]:
        """Every live process of this server's session (itself, Ray's, the workers')."""
        return session_members(self.sid) if self.sid else []

    def find(self, title: str) -> list[int]:
        """The server's processes whose command line starts with `title`."""
        return [pid for pid in self.pids() if cmdline(pid).startswith(title)]

    def gateway_pids(self) -> list[int]:
        """The gateway replicas' processes (one per --gateway-replicas)."""
        return self.find(GATEWAY_TITLE)

    def gateway_pid(self) -> int | None:
        """The first gateway replica's process (the only one, unless --gateway-replicas)."""
        found = self.gateway_pids()
        return found[0] if found else None

    def session_dir(self) -> Path | None:
        """The local Ray's session directory (from its gcs_server's flags)."""
        for pid in self.pids():
            for arg in cmdline(pid).split():
                if arg.startswith("--session-dir=") and "gcs_server" in cmdline(pid).split()[0]:
                    return Path(arg.split("=", 1)[1])
        return None

    def ray_address(self) -> str:
        """127.0.0.1:<GCS port> of the server's local Ray."""
        session = self.session_dir()
        if session is None:
            raise RuntimeError("no gcs_server among the server's processes")
        ports = list(session.glob("gcs_server_port_*"))
        if not ports:
            raise RuntimeError(f"no gcs_server_port file in {session}")
        return f"127.0.0.1:{int(ports[0].read_text().strip())}"

    def send(self, pid: int, sig: signal.Signals) -> None:
        """Send `sig` to `pid`, one of this server's processes (checked: never another's)."""
        if session_of(pid) != self.sid:
            raise ValueError(f"pid {pid} is not a process of this server (session {self.sid})")
        if sig is signal.SIGSTOP:
            self._frozen.add(pid)
        os.kill(pid, sig)
        if sig is signal.SIGCONT:
            self._frozen.discard(pid)

    def kill_main(self, sig: signal.Signals = signal.SIGKILL) -> int:
        """Signal the `pdserve serve` process itself; returns its pid."""
        assert self.proc is not None
        os.kill(self.proc.pid, sig)
        return self.proc.pid

    def stop(self, timeout_s: float = 20.0) -> list[int]:
        """SIGTERM `pdserve serve` (Ray's driver handler shuts local Ray down), then
        SIGKILL whatever of its session is left after `timeout_s`, each by pid.
        Returns the pids that needed SIGKILL."""
        sids = {self.sid, *self.old_sids}
        for pid in list(self._frozen):
            # One stopped and then killed (Ray's kill in (j)) is gone, its pid free for any process.
            if session_of(pid) in sids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)
        self._frozen.clear()
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        killed = self.reap(timeout_s=5.0)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        return killed

    def reap(self, timeout_s: float = 5.0) -> list[int]:
        """SIGKILL every process left in this server's sessions (the current one and
        those of earlier starts); wait (bounded) until they are gone."""
        sids = [self.sid, *self.old_sids] if self.sid else list(self.old_sids)
        left = [(pid, sid) for sid in sids for pid in session_members(sid)]
        for pid, sid in left:
            if session_of(pid) == sid:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(alive(p) for p, _ in left):
            time.sleep(0.05)
        return [p for p, _ in left]
