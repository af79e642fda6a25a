"""Engines sharing a CPU node take turns at its cores (workers/cpu_turns.py): one at a time,
a waiting engine gets the next turn, a dead holder frees the turn, a stuck one delays a
step by at most the deadline, and the engine's step waits for its turn."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.cluster.placement import CpuSharing, worker_share
from pdserve.cluster.stall_watch import DEFAULT_STALL_TIMEOUT_S
from pdserve.workers import cpu_turns
from pdserve.workers.config import EngineConfig
from pdserve.workers.cpu_turns import CpuTurns, turns_path
from pdserve.workers.tiny.builder import TinyModelSpec


def test_turns_never_overlap(tmp_path: Path) -> None:
    path = str(tmp_path / "turns.lock")
    inside: list[int] = []
    overlaps: list[int] = []

    def worker(me: int) -> None:
        turns = CpuTurns(path)
        for _ in range(40):
            with turns:
                inside.append(me)
                if len(inside) > 1:
                    overlaps.append(me)
                time.sleep(0.0005)
                inside.remove(me)
        turns.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert overlaps == []


def test_a_waiting_engine_gets_the_next_turn(tmp_path: Path) -> None:
    """A holder that steps back to back hands the turn to a waiter after its current
    step, not after all of its steps."""
    path = str(tmp_path / "turns.lock")
    busy, waiter = CpuTurns(path), CpuTurns(path)
    stop = threading.Event()
    started = threading.Event()

    def hog() -> None:
        while not stop.is_set():
            with busy:
                started.set()
                time.sleep(0.02)  # a 20 ms step

    t = threading.Thread(target=hog)
    t.start()
    assert started.wait(5)
    waits = []
    for _ in range(5):
        start = time.perf_counter()
        with waiter:
            waits.append(time.perf_counter() - start)
        time.sleep(0.005)
    stop.set()
    t.join(timeout=5)
    assert max(waits) < 0.1, waits  # within about one of the holder's steps (20 ms), never starved
    assert busy.given >= 4 and waiter.missed == 0


def test_a_killed_holder_frees_the_turn(tmp_path: Path) -> None:
    path = str(tmp_path / "turns.lock")
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        turns = CpuTurns(path)
        got = threading.Event()

        def take() -> None:
            with turns:
                got.set()

        t = threading.Thread(target=take)
        t.start()
        assert not got.wait(0.3)  # held by the other process
        os.kill(holder.pid, signal.SIGKILL)
        assert got.wait(5)
        t.join(timeout=5)
        assert turns.missed == 0
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_a_stuck_holder_delays_a_step_by_the_deadline_at_most(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_turns, "ACQUIRE_DEADLINE_S", 0.2)
    path = str(tmp_path / "turns.lock")
    stuck, turns = CpuTurns(path), CpuTurns(path)
    stuck.__enter__()
    try:
        start = time.perf_counter()
        with turns:
            pass
        assert 0.2 <= time.perf_counter() - start < 2.0
        assert turns.missed == 1
    finally:
        stuck.__exit__(None, None, None)
    with turns:  # the turn is free again, and was never taken by the step that went without it
        assert turns.missed == 1


def _hold(path: str, kind: str = "EX") -> subprocess.Popen[str]:
    """Another process holding `path` locked (the turn: a worker stopped inside its step) until killed."""
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
            f"fcntl.flock(fd, fcntl.LOCK_{kind}); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_stopped_holder_holds_a_step_well_under_the_stall_timeout(tmp_path: Path) -> None:
    """The engine thread waiting for the turn answers none of the gateway's polls (they run
    between steps) and computes nothing: waiting past the stall timeout (10 s) had the stall
    watch take the healthy worker for stalled and restart it, beside the stopped one."""
    path = str(tmp_path / "turns.lock")
    holder = _hold(path)
    turns = CpuTurns(path)
    stepped = threading.Event()

    def step() -> None:
        with turns:
            stepped.set()

    t = threading.Thread(target=step)
    t.start()
    try:
        assert stepped.wait(DEFAULT_STALL_TIMEOUT_S / 2)
        assert turns.missed == 1
    finally:
        holder.kill()
        holder.wait(timeout=10)
        t.join(timeout=60)
        turns.close()


def test_a_stopped_holder_delays_one_step_not_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A neighbour stopped (SIGSTOP, a hung step) inside its turn keeps the lock until it dies:
    one step waits the deadline, the next ones only try, until the turn is free again. Were each
    step to wait, the engine beside it would make one token per deadline (30 s) for every stream."""
    monkeypatch.setattr(cpu_turns, "ACQUIRE_DEADLINE_S", 0.2)
    path = str(tmp_path / "turns.lock")
    holder = _hold(path)
    turns = CpuTurns(path)
    try:
        start = time.perf_counter()
        with turns:
            pass
        assert time.perf_counter() - start >= 0.2
        start = time.perf_counter()
        for _ in range(5):
            with turns:
                pass
        assert time.perf_counter() - start < 0.2  # no more waiting
        assert turns.missed == 6
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        with turns:  # free again: the turn is taken, not gone without
            assert turns.missed == 6
        other = CpuTurns(path)
        other.__enter__()  # a turn of a neighbour that is not stuck: waited for again
        timer = threading.Timer(0.1, other.__exit__, args=(None, None, None))
        timer.start()
        start = time.perf_counter()
        with turns:
            assert turns.missed == 6
        assert time.perf_counter() - start >= 0.05
        timer.join()
        other.close()
    finally:
        holder.kill()
        holder.wait(timeout=10)
        turns.close()


def _until_wanted(want: str, timeout_s: float) -> bool:
    """Whether a worker came to wait for the turn (it holds `want` shared) within `timeout_s`."""
    fd = os.open(want, os.O_RDWR)
    try:
        deadline = time.perf_counter() + timeout_s
        while cpu_turns._try(fd, fcntl.LOCK_EX):
            fcntl.flock(fd, fcntl.LOCK_UN)
            if time.perf_counter() >= deadline:
                return False
            time.sleep(0.001)
        return True
    finally:
        os.close(fd)


def test_a_stopped_waiter_delays_one_handoff_not_each(tmp_path: Path) -> None:
    """A worker stopped (SIGSTOP) while it waits for the turn keeps its `want` lock until it
    dies: the holder waits once for it to take the turn it gave, not after each of its steps
    (each was HANDOFF_DEADLINE_S, 50 ms, longer: a 20 ms decode step took 70). A waiter that
    takes the turn is handed it again."""
    path = str(tmp_path / "turns.lock")
    waiter = _hold(path + ".want", "SH")
    turns = CpuTurns(path)
    try:
        with turns:
            pass  # the handoff it gives is never taken: it waits the deadline once
        start = time.perf_counter()
        for _ in range(10):
            with turns:
                pass
        assert time.perf_counter() - start < 5 * cpu_turns.HANDOFF_DEADLINE_S, turns.stats()
        os.kill(waiter.pid, signal.SIGKILL)
        waiter.wait(timeout=10)
        with turns:
            pass  # nobody waits: the handoffs are back to normal
        other, given = CpuTurns(path), turns.given
        took, release = threading.Event(), threading.Event()

        def wait_for_turn() -> None:
            with other:
                took.set()
                release.wait(5)  # its step

        turns.__enter__()
        t = threading.Thread(target=wait_for_turn)
        t.start()
        assert _until_wanted(path + ".want", 5.0)  # the other worker waits for the turn
        turns.__exit__(None, None, None)  # hands the turn over: waits until the other took it
        assert not cpu_turns._try(turns._turn, fcntl.LOCK_EX)  # the other's now, not up for grabs
        assert took.wait(5) and turns.given == given + 1
        release.set()
        t.join(timeout=5)
        other.close()
    finally:
        waiter.kill()
        waiter.wait(timeout=10)
        turns.close()


def test_an_engine_steps_only_in_its_turn(make_model: Callable[[TinyModelSpec], Path], tmp_path: Path) -> None:
    path = str(tmp_path / "turns.lock")
    llm = LLM(str(make_model(tiny_spec())), cpu_turns=path, num_kv_blocks=32, max_model_len=128)
    other = CpuTurns(path)
    result: list[list[int]] = []
    with other:  # another engine's step is running
        t = threading.Thread(target=lambda: result.append(
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
            .outputs[0].token_ids))
        t.start()
        t.join(timeout=0.5)
        assert t.is_alive() and not result  # waiting for the turn
    t.join(timeout=30)
    assert len(result) == 1 and len(result[0]) == 4
    assert isinstance(llm.engine.cpu_turn, CpuTurns) and llm.engine.cpu_turn.turns >= 4


def test_cpu_turns_is_a_path_or_none() -> None:
    with pytest.raises(ValueError, match="cpu_turns"):
        EngineConfig(model="m", cpu_turns="")
    assert "cpu_turns" not in EngineConfig.settings()  # the cluster sets it, not a user


@pytest.mark.parametrize("files", [
    {"cpu.max": "100000 100000\n"},  # cgroup v2, `docker run --cpus 1`
    {"cpu.max": "50000 100000\n"},  # half a CPU: one thread still
    {"cpu.max": "150000 100000\n"},  # whole CPUs, as Ray counts them
    {"cpu.max": "max 100000\n"},  # no quota
    {"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"},  # cgroup v1
    {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},  # v1, no quota
    {},  # no cgroup files at all
])
def test_node_cores_are_capped_by_a_containers_cpu_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        files: dict[str, str]) -> None:
    """In a container with a CPU limit (`docker --cpus`, a Kubernetes limit) the affinity still
    lists every core of the host, while Ray counts the limit as the node's CPUs (the oracle here,
    on the same files): a lending worker's wide steps, or a worker's turns, ran as many threads
    as the host has cores on a quota of a few, throttled by the kernel at every step."""
    ray_utils = pytest.importorskip("ray._private.utils")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(cpu_turns, "CGROUP_DIR", str(tmp_path), raising=False)
    affinity = len(os.sched_getaffinity(0))
    quota = ray_utils._get_docker_cpus(str(tmp_path / "cpu/cpu.cfs_quota_us"), str(tmp_path / "cpu/cpu.cfs_period_us"),
                                       str(tmp_path / "no-cpuset"), str(tmp_path / "cpu.max"))
    expected = affinity if quota is None else max(1, min(affinity, int(quota)))
    assert cpu_turns.node_cores() == expected


def test_turns_paths_are_per_app() -> None:
    a, b = turns_path("pdserve-8000", "/tmp"), turns_path("pdserve-8001", "/tmp")
    assert a != b and a.startswith("/tmp/") and turns_path("../x y", "/tmp").startswith("/tmp/pdserve-cpu-turns-")


@pytest.mark.parametrize(("sharing", "workers", "turns", "threads"), [
    (CpuSharing.SPLIT, 2, False, 4), (CpuSharing.SPLIT, 1, False, 8), (CpuSharing.SPLIT, 3, False, 2),
    (CpuSharing.TURNS, 1, True, 8), (CpuSharing.TURNS, 3, True, 8)])
def test_cpu_workers_share_by_turns_or_split(sharing: CpuSharing, workers: int, turns: bool, threads: int) -> None:
    share = worker_share("auto", workers, {"CPU": 8}, sharing)
    assert (share.turns, share.threads) == (turns, threads)


def test_gpu_workers_never_take_turns() -> None:
    share = worker_share("auto", 2, {"CPU": 8, "GPU": 2}, CpuSharing.TURNS)
    assert not share.turns and share.options == {"num_gpus": 1}


def test_the_serve_setting_names_its_choices() -> None:
    from pdserve.cluster.serve_config import ServeConfig

    assert ServeConfig(EngineConfig(model="m"), cpu_sharing="turns").cpu_sharing is CpuSharing.TURNS  # type: ignore[arg-type]
    assert ServeConfig(EngineConfig(model="m")).cpu_sharing is CpuSharing.AUTO
    with pytest.raises(ValueError, match="cpu_sharing: must be one of 'split', 'turns', 'lend' or 'auto'"):
        ServeConfig(EngineConfig(model="m"), cpu_sharing="sometimes")  # type: ignore[arg-type]
