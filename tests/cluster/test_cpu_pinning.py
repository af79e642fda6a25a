"""Decode workers on cores of their own (cluster/cpu_pinning.py): the plan gives each decode
worker as many cores as threads from the top and the prefill workers what is below, or
nothing when they would have no core; applying it moves every thread of the named workers
below the root, and no other process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from pdserve.cluster.background_priority import descendants
from pdserve.cluster.cpu_pinning import CpuPinning, Pins, apply, plan
from pdserve.cluster.serve_config import ServeConfig
from pdserve.workers.config import EngineConfig

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc, sets CPU affinity")

CHILD = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
if len(sys.argv) > 1:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
print("ready", flush=True)
time.sleep(30)
"""


def test_each_decode_worker_gets_its_threads_in_cores_from_the_top() -> None:
    assert plan([0, 1], [(100, 1)], [200]) == Pins({100: frozenset({1})}, frozenset({0}), frozenset({200}))
    pins = plan(range(8), [(100, 2), (101, 3)], [200, 201])
    assert pins == Pins({100: frozenset({6, 7}), 101: frozenset({3, 4, 5})}, frozenset({0, 1, 2}),
                        frozenset({200, 201}))
    assert pins.cores() == {100: frozenset({6, 7}), 101: frozenset({3, 4, 5}), 200: frozenset({0, 1, 2}),
                            201: frozenset({0, 1, 2})}
    # A container's cpuset need not be contiguous, nor given in order.
    assert plan([7, 2, 5, 0], [(100, 1)]) == Pins({100: frozenset({7})}, frozenset({0, 2, 5}))


@pytest.mark.parametrize("cores, decode", [
    ([0], [(100, 1)]),  # one core: nothing left for the prefill workers
    ([0, 1], [(100, 2)]),  # the decode worker would take every core
    ([0, 1, 2], [(100, 1), (101, 2)]),
    ([0, 1], []),  # no decode worker to pin
    ([0, 1], [(100, 0)]),  # a worker without a fixed share (it lends cores or takes turns)
    ([0, 1, 2, 3], [(100, 1), (101, 0)]),
])
def test_nothing_is_pinned_when_prefill_would_have_no_core_or_a_worker_needs_them_all(
        cores: list[int], decode: list[tuple[int, int]]) -> None:
    assert plan(cores, decode) is None


def test_the_setting_is_auto_or_off() -> None:
    assert ServeConfig(EngineConfig(model="m")).cpu_pinning is CpuPinning.AUTO
    assert ServeConfig(EngineConfig(model="m"), cpu_pinning="off").cpu_pinning is CpuPinning.OFF  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cpu_pinning"):
        ServeConfig(EngineConfig(model="m"), cpu_pinning="decode")  # type: ignore[arg-type]


@pytest.fixture
def tree() -> Iterator[tuple[subprocess.Popen[str], subprocess.Popen[str]]]:
    """Two children with a second thread each; the first with a grandchild."""
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, *extra], stdout=subprocess.PIPE, text=True)
             for extra in (["grandchild"], [])]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield procs[0], procs[1]
    finally:
        for proc in procs:
            for pid in descendants(proc.pid):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            proc.kill()
            proc.wait(timeout=10)


def _threads_on(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_applying_moves_every_thread_of_the_workers_below_the_root_and_nothing_else(
        tree: tuple[subprocess.Popen[str], subprocess.Popen[str]]) -> None:
    root, outsider = tree
    (grandchild,) = descendants(root.pid)
    everything = frozenset(os.sched_getaffinity(0))
    cores = sorted(everything)
    before = {pid: _threads_on(pid) for pid in (root.pid, outsider.pid)}
    # The grandchild plays the decode worker, the outsider (not below the root) a prefill worker.
    pins = Pins({grandchild: frozenset(cores[-1:])}, frozenset(cores[:-1]), frozenset({outsider.pid}))
    assert apply(pins, root.pid) == 1
    assert _threads_on(grandchild) == {frozenset(cores[-1:])}
    assert {pid: _threads_on(pid) for pid in (root.pid, outsider.pid)} == before  # no worker / not below
    # Below the root now, with its two threads: the prefill worker's cores.
    assert apply(pins, os.getpid()) == 2
    assert _threads_on(outsider.pid) == {frozenset(cores[:-1])}
    apply(Pins({}, everything, frozenset({grandchild, outsider.pid})), os.getpid())  # and back
    assert _threads_on(grandchild) == _threads_on(outsider.pid) == {everything}
