"""Decode workers on cores of their own (cluster/cpu_pinning.py): the plan gives each decode
worker as many cores as threads from the top and the rest what is below, or nothing when
the rest would have no core; applying it moves every thread of the processes below the
root, and nothing that is not below it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from factories import kill_tree, start_child

from pdserve.cluster.background_priority import descendants
from pdserve.cluster.cpu_pinning import CpuPinning, Pins, apply, plan
from pdserve.cluster.serve_config import ServeConfig
from pdserve.workers.config import EngineConfig

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc, sets CPU affinity")

def test_each_decode_worker_gets_its_threads_in_cores_from_the_top() -> None:
    assert plan([0, 1], [(100, 1)]) == Pins({100: frozenset({1})}, frozenset({0}))
    assert plan(range(8), [(100, 2), (101, 3)]) == Pins({100: frozenset({6, 7}), 101: frozenset({3, 4, 5})},
                                                      frozenset({0, 1, 2}))
    # A container's cpuset need not be contiguous, nor given in order.
    assert plan([7, 2, 5, 0], [(100, 1)]) == Pins({100: frozenset({7})}, frozenset({0, 2, 5}))


@pytest.mark.parametrize("cores, decode", [
    ([0], [(100, 1)]),  # one core: nothing left for the rest
    ([0, 1], [(100, 2)]),  # the decode worker would take every core
    ([0, 1, 2], [(100, 1), (101, 2)]),
    ([0, 1], []),  # no decode worker to pin
    ([0, 1], [(100, 0)]),  # a worker without a fixed share (it lends cores or takes turns)
    ([0, 1, 2, 3], [(100, 1), (101, 0)]),
])
def test_nothing_is_pinned_when_the_rest_would_have_no_core_or_a_worker_needs_them_all(
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
    procs: list[subprocess.Popen[str]] = []
    try:
        procs += [start_child("child", "grandchild"), start_child("outsider")]
        yield procs[0], procs[1]
    finally:
        for proc in procs:
            kill_tree(proc)


def _threads_on(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_applying_moves_every_thread_below_the_root_and_nothing_else(
        tree: tuple[subprocess.Popen[str], subprocess.Popen[str]]) -> None:
    root, outsider = tree
    (grandchild,) = descendants(root.pid)
    everything = frozenset(os.sched_getaffinity(0))
    cores = sorted(everything)
    before = _threads_on(outsider.pid)
    # The grandchild plays the decode worker; the root (and its other thread) the rest.
    pins = Pins({grandchild: frozenset(cores[-1:])}, frozenset(cores[:-1]))
    assert apply(pins, root.pid) == 2
    assert _threads_on(grandchild) == {frozenset(cores[-1:])}
    assert _threads_on(root.pid) == {frozenset(cores[:-1])}  # both of its threads
    assert _threads_on(outsider.pid) == before  # not below the root
    apply(Pins({}, everything), root.pid)  # and back
    assert _threads_on(grandchild) == _threads_on(root.pid) == {everything}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_decode_workers_own_processes_share_its_cores(
        tree: tuple[subprocess.Popen[str], subprocess.Popen[str]]) -> None:
    """A tensor-parallel decode worker's other ranks are processes it started: they step on its
    cores, not on the rest's (where they would compete with the serving plane)."""
    root, _ = tree
    (rank,) = descendants(root.pid)
    everything = frozenset(os.sched_getaffinity(0))
    cores = sorted(everything)
    # The child plays the decode worker (and the root apply walks from), the grandchild its second rank.
    pins = Pins({root.pid: frozenset(cores[-1:])}, frozenset(cores[:-1]))
    try:
        assert apply(pins, root.pid) == 2
        assert _threads_on(root.pid) == _threads_on(rank) == {frozenset(cores[-1:])}
    finally:
        apply(Pins({}, everything), root.pid)
