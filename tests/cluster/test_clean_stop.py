"""A stop is a stop: SIGTERM or SIGINT to `pdserve serve`'s process or to its process group
(what systemd, Kubernetes and Ctrl-C send) ends it with exit 0 and one line, no traceback
and no crash report, and nothing it started left running (cluster/shutdown.py).

Each case starts a real `pdserve serve --model tiny` in a session of the test's own, so that
the group signal reaches only what the test started; leftovers are looked for by pid (with
its start time) among its descendants and every session they made (tests/served.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from served import Server, alive

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

STOP_TIMEOUT_S = 60.0  # past the stop's own bound (shutdown.STOP_DEADLINE_S), so that one is what fires

CASES = {
    "SIGTERM-process": (signal.SIGTERM, False),  # `kill PID`; systemd's KillMode=mixed
    "SIGTERM-group": (signal.SIGTERM, True),  # systemd's default KillMode=control-group, a container's stop
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


@pytest.mark.parametrize("case", CASES)
def test_a_signal_stops_the_server_cleanly(case: str, tmp_path: Path) -> None:
    sig, to_group = CASES[case]
    server = Server(["--model", "tiny"], tmp_path / "stderr.txt")
    try:
        server.start().wait_ready()
        assert server.proc is not None
        # The driver, Ray's processes, the workers, HAProxy: the tree is seen.
        assert len(server.started) > 5, server.started
        (os.killpg if to_group else os.kill)(server.proc.pid, sig)
        assert_stopped_cleanly(server, sig)
    finally:
        server.kill()
