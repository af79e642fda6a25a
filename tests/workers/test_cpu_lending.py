"""Engines sharing a CPU node lend each other its cores (workers/cpu_lending.py): a step on
all of them while the neighbours are idle, the share while they have work; a worker that
turns busy waits for at most the wide step then running; a dead neighbour lends its cores;
a stuck one delays a step by at most the deadline; an engine compiles for both thread
counts at start and steps wide alone, with the tokens a plain engine on all the cores gives."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.cluster.placement import LEND_MIN_WEIGHT_BYTES, CpuSharing, worker_share
from pdserve.workers import cpu_lending
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.config import EngineConfig
from pdserve.workers.cpu_lending import CpuLending, lending_dir
from pdserve.workers.cpu_turns import node_cores
from pdserve.workers.tiny.builder import TinyModelSpec


class Worker:
    """A CpuLending whose 'has work' is a flag the test sets."""

    def __init__(self, directory: Path, share: int = 1, wide: int = 2) -> None:
        self.work = True
        self.lending = CpuLending(str(directory), share, wide, lambda: self.work)

    def step(self) -> int:
        """One step: the thread count it ran at."""
        with self.lending:
            return torch.get_num_threads()


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_alone_a_worker_steps_on_all_the_cores(tmp_path: Path, threads: None) -> None:
    torch.set_num_threads(1)
    a = Worker(tmp_path)
    assert [a.step() for _ in range(3)] == [2, 2, 2]
    assert torch.get_num_threads() == 1  # back to its share between steps
    assert a.lending.stats() == {"steps": 3, "wide_steps": 3, "waited_s": pytest.approx(0, abs=0.5), "missed": 0}
    assert a.lending.thread_counts == (1, 2)
    a.lending.close()


def test_workers_with_work_step_at_their_shares_and_idle_ones_lend(tmp_path: Path, threads: None) -> None:
    a, b = Worker(tmp_path), Worker(tmp_path)
    assert a.step() == 2  # b has not stepped: not busy yet
    assert b.step() == 1  # a has work
    assert a.step() == 1  # so has b
    a.work = False
    assert a.step() == 1  # b is busy; a's step ends with no work: a stops being busy
    assert b.step() == 2 and b.step() == 2  # a lends its core
    a.work = True
    assert a.step() == 1 and b.step() == 1  # a has work again
    assert b.lending.wide_steps == 2 and a.lending.wide_steps == 1
    a.lending.close()
    assert b.step() == 2  # a closed (its engine went away): its busy file is gone
    b.lending.close()
    assert not [n for n in os.listdir(tmp_path) if n.startswith("busy-")]


def test_a_worker_turning_busy_waits_for_the_wide_step_then_both_share(tmp_path: Path, threads: None) -> None:
    a, b = Worker(tmp_path), Worker(tmp_path)
    ran: list[int] = []
    a.lending.__enter__()  # a's wide step is running
    assert torch.get_num_threads() == 2
    t = threading.Thread(target=lambda: ran.append(b.step()))
    t.start()
    t.join(timeout=0.3)
    assert t.is_alive() and not ran  # b waits for a's step: two models never fight for the cores
    a.lending.__exit__(None, None, None)
    t.join(timeout=5)
    assert ran == [1]
    assert a.step() == 1  # b has work now: a steps at its share
    assert b.lending.waited_s >= 0.3 and b.lending.missed == 0
    a.lending.close()
    b.lending.close()


def test_concurrent_steps_never_run_wide_beside_another_step(tmp_path: Path, threads: None) -> None:
    inside: list[int] = []
    overlaps: list[tuple[int, ...]] = []
    guard = threading.Lock()

    def run(me: int) -> None:
        w = Worker(tmp_path)
        for i in range(40):
            w.work = i % 3 != 0  # now and then idle after a step
            with w.lending:
                n = torch.get_num_threads()
                with guard:
                    inside.append(n)
                    if len(inside) > 1 and 2 in inside:
                        overlaps.append(tuple(inside))
                time.sleep(0.0005)
                with guard:
                    inside.remove(n)
        w.lending.close()

    workers = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in workers)
    assert overlaps == []


def _hold(path: Path, kind: str) -> subprocess.Popen[str]:
    """Another process holding `path` locked (LOCK_EX) until killed."""
    code = (f"import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
            f"fcntl.flock(fd, fcntl.LOCK_{kind}); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_dead_neighbour_lends_its_cores(tmp_path: Path, threads: None) -> None:
    a = Worker(tmp_path)
    holder = _hold(tmp_path / "busy-999999-1", "EX")  # a neighbour with work, by its busy lock
    try:
        (tmp_path / "busy-999999-1").rename(tmp_path / f"busy-{holder.pid}-1")  # named by its pid
        assert a.step() == 1
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        assert a.step() == 2
        assert not (tmp_path / f"busy-{holder.pid}-1").exists()  # its file cleared on the way
    finally:
        holder.kill()
        holder.wait(timeout=10)
        a.lending.close()


def test_a_killed_wide_stepper_frees_the_node(tmp_path: Path, threads: None) -> None:
    a = Worker(tmp_path)
    holder = _hold(tmp_path / "wide.lock", "EX")
    try:
        got = threading.Event()
        t = threading.Thread(target=lambda: (a.step(), got.set()))
        t.start()
        assert not got.wait(0.3)
        os.kill(holder.pid, signal.SIGKILL)
        assert got.wait(5)
        t.join(timeout=5)
        assert a.lending.missed == 0
    finally:
        holder.kill()
        holder.wait(timeout=10)
        a.lending.close()


def test_a_stuck_wide_stepper_delays_a_step_by_the_deadline_at_most(tmp_path: Path, threads: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_lending, "ACQUIRE_DEADLINE_S", 0.2)
    stuck, a = Worker(tmp_path), Worker(tmp_path)
    stuck.lending.__enter__()
    try:
        start = time.perf_counter()
        assert a.step() == 1
        assert 0.2 <= time.perf_counter() - start < 2.0
        assert a.lending.missed == 1
    finally:
        stuck.lending.__exit__(None, None, None)
    stuck.lending.close()
    a.lending.close()


def test_a_removed_directory_fails_no_step_and_holds_no_lock(tmp_path: Path, threads: None) -> None:
    """The directory goes from under running workers (a cleanup of /dev/shm, systemd's RemoveIPC
    at the user's logout): a step that cannot see its neighbours steps at its share, rather than
    raising (which ended the engine thread, failing every request on it) with `wide.lock` held."""
    d = tmp_path / "lend"
    a, b = Worker(d), Worker(d)
    b.work = False
    assert b.step() == 2  # alone: wide, then idle
    shutil.rmtree(d)
    assert a.step() == 1  # its neighbours unseen: its share
    assert b.step() == 1  # the lock (their one inode still) is free: no wait
    assert a.lending.missed == b.lending.missed == 0
    a.lending.close()
    b.lending.close()


def test_shares_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="share"):
        CpuLending(str(tmp_path), 0, 2, lambda: True)
    with pytest.raises(ValueError, match="share"):
        CpuLending(str(tmp_path), 3, 2, lambda: True)


@pytest.mark.slow
def test_an_engine_compiles_both_counts_and_steps_wide_alone(make_model: Callable[[TinyModelSpec], Path],
                                                             tmp_path: Path, threads: None) -> None:
    if node_cores() < 2:
        pytest.skip("needs 2 cores")
    model = str(make_model(tiny_spec()))
    kw = dict(num_kv_blocks=32, max_model_len=128, enforce_eager=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    torch.set_num_threads(node_cores())
    plain = [o.outputs[0].token_ids for o in LLM(model, **kw).generate(prompts, params)]  # type: ignore[arg-type]
    torch.set_num_threads(1)
    llm = LLM(model, cpu_lending=str(tmp_path / "lend"), **kw)  # type: ignore[arg-type]
    lending = llm.engine.cpu_turn
    assert isinstance(lending, CpuLending) and lending.thread_counts == (1, node_cores())
    graphs = dict(torch._dynamo.utils.counters["stats"])
    lent = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert dict(torch._dynamo.utils.counters["stats"]) == graphs  # both counts compiled at start, none while serving
    assert lent == plain  # alone, every step ran on all the cores: the same graphs and tokens
    assert lending.steps > 0 and lending.wide_steps == lending.steps
    neighbour = Worker(tmp_path / "lend")
    neighbour.step()  # a neighbour with work
    llm.generate(prompts, params)
    assert lending.wide_steps < lending.steps and neighbour.lending.stats()["wide_steps"] == 1
    neighbour.lending.close()
    lending.close()


def test_cpu_lending_is_a_path_or_none_and_not_with_turns() -> None:
    with pytest.raises(ValueError, match="cpu_lending"):
        EngineConfig(model="m", cpu_lending="")
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(model="m", cpu_lending="/tmp/x", cpu_turns="/tmp/y")
    assert "cpu_lending" not in EngineConfig.settings()  # the cluster sets it, not a user


def test_lending_dirs_are_per_app() -> None:
    a, b = lending_dir("pdserve-8000", "/tmp"), lending_dir("pdserve-8001", "/tmp")
    assert a != b and lending_dir("../x y", "/tmp").startswith("/tmp/pdserve-cpu-lending-")
    assert "/" not in lending_dir("../x y", "/tmp")[len("/tmp/"):]


def test_lending_workers_get_their_split_share() -> None:
    share = worker_share("auto", 2, {"CPU": 8}, CpuSharing.LEND)
    assert (share.lend, share.turns, share.threads, share.lend_min_weight_bytes) == (True, False, 4, 0)
    assert not worker_share("auto", 2, {"CPU": 8, "GPU": 2}, CpuSharing.LEND).lend


def test_auto_sharing_lends_only_for_a_model_large_enough() -> None:
    """`auto` (the default) is lending with a floor on the model's size, which the engine checks."""
    share = worker_share("auto", 2, {"CPU": 8}, CpuSharing.AUTO)
    assert (share.lend, share.threads, share.lend_min_weight_bytes) == (True, 4, LEND_MIN_WEIGHT_BYTES)
    assert not worker_share("auto", 2, {"CPU": 8, "GPU": 2}, CpuSharing.AUTO).lend
    with pytest.raises(ValueError, match="cpu_lending_min_weight_bytes"):
        EngineConfig(model="m", cpu_lending_min_weight_bytes=-1)
    assert "cpu_lending_min_weight_bytes" not in EngineConfig.settings()


def test_an_engine_too_small_to_lend_steps_on_its_share(make_model: Callable[[TinyModelSpec], Path],
                                                        tmp_path: Path, threads: None) -> None:
    """Under the floor an engine neither lends nor takes any lock: its neighbours load the
    same model and decide alike. At or over it, it lends like `lend`."""
    if node_cores() < 2:
        pytest.skip("needs 2 cores")
    torch.set_num_threads(1)
    model = str(make_model(tiny_spec()))
    small = LLM(model, cpu_lending=str(tmp_path / "s"), cpu_lending_min_weight_bytes=1 << 40,  # type: ignore[arg-type]
                num_kv_blocks=32, max_model_len=128)
    assert not isinstance(small.engine.cpu_turn, CpuLending)
    out = small.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    assert not (tmp_path / "s").exists() or not any(p.name.startswith("busy-") for p in (tmp_path / "s").iterdir())
    big = LLM(model, cpu_lending=str(tmp_path / "b"), cpu_lending_min_weight_bytes=1,  # type: ignore[arg-type]
              num_kv_blocks=32, max_model_len=128)
    assert isinstance(big.engine.cpu_turn, CpuLending) and big.engine.cpu_turn.thread_counts == (1, node_cores())
    big.engine.cpu_turn.close()


def _lending_llm(model: str, directory: Path, min_weight_bytes: int, split_threads: int) -> LLM:
    """An engine given the node's cores to lend, over `min_weight_bytes` of weights, and a split share."""
    return LLM(model, cpu_lending=str(directory), cpu_lending_min_weight_bytes=min_weight_bytes,  # type: ignore[arg-type]
               cpu_split_threads=split_threads, num_kv_blocks=32, max_model_len=128)


def test_a_small_model_steps_on_the_split_share_a_big_one_on_all(make_model: Callable[[TinyModelSpec], Path],
                                                                  tmp_path: Path, threads: None) -> None:
    """A lone colocated worker is given every core to lend (`threads`) and a split share that
    leaves the serving plane one (`cpu_split_threads`): under the lending floor it compiles and
    steps on the split share (its engine thread too), over it on every core, with no locks."""
    cores = node_cores()
    if cores < 2:
        pytest.skip("needs 2 cores")
    model = str(make_model(tiny_spec()))
    torch.set_num_threads(cores)
    small = _lending_llm(model, tmp_path / "s", 1 << 40, cores - 1)
    assert small.engine.torch_threads == cores - 1 and not small.engine.shares_cores_by_step
    async_engine = AsyncEngine(small.engine)
    assert async_engine.torch_threads == cores - 1
    big = _lending_llm(model, tmp_path / "b", 1, cores - 1)  # the caller's count is still `cores`
    assert big.engine.torch_threads == cores and not big.engine.shares_cores_by_step  # alone: nothing to lend
    with pytest.raises(ValueError, match="cpu_split_threads"):
        EngineConfig(model="m", cpu_split_threads=-1)
    assert "cpu_split_threads" not in EngineConfig.settings()


def test_an_engine_leaves_its_callers_thread_count_and_steps_on_its_own(
        make_model: Callable[[TinyModelSpec], Path], tmp_path: Path, threads: None) -> None:
    """OpenMP's count is per thread, and building an engine on its split share set that share on
    the caller's thread for good: a second engine built there took 1 thread for all its cores
    (so did a one-rank engine after a two-rank one). The caller keeps its count; a step runs on
    the engine's share wherever it is called from, and gives the caller's back."""
    cores = node_cores()
    if cores < 2:
        pytest.skip("needs 2 cores")
    model = str(make_model(tiny_spec()))
    torch.set_num_threads(cores)
    small = _lending_llm(model, tmp_path / "s", 1 << 40, 1)
    assert small.engine.torch_threads == 1 and torch.get_num_threads() == cores
    plain = LLM(model, num_kv_blocks=32, max_model_len=128)
    assert plain.engine.torch_threads == cores
    seen: list[int] = []
    small.engine.step_observers.append(lambda stats: seen.append(torch.get_num_threads()))
    out = small.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3 and seen and set(seen) == {1}
    assert torch.get_num_threads() == cores


def test_an_engine_left_with_nothing_to_step_lends_its_cores(make_model: Callable[[TinyModelSpec], Path],
                                                             tmp_path: Path, threads: None) -> None:
    """Its last request aborted between steps: the engine is not busy any more, though it
    never ran another step to say so (the async loop calls `cpu_idle`, as `step` does)."""
    torch.set_num_threads(1)
    llm = LLM(str(make_model(tiny_spec())), cpu_lending=str(tmp_path), num_kv_blocks=32, max_model_len=128)
    engine, neighbour = llm.engine, Worker(tmp_path)
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.step()
    assert neighbour.step() == 1  # the engine has work
    engine.abort("r")
    assert neighbour.step() == 1  # still marked busy: it has not looked since
    engine.cpu_idle()
    assert neighbour.step() == 2
    engine.add_request("s", [5, 6, 7, 8], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.step()
    assert neighbour.step() == 1
    engine.abort("s")
    engine.step()  # nothing to schedule: idle too
    assert neighbour.step() == 2
    neighbour.lending.close()
    assert isinstance(engine.cpu_turn, CpuLending)
    engine.cpu_turn.close()


def test_a_stopped_wide_stepper_delays_one_step_not_each(tmp_path: Path, threads: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A neighbour stopped (SIGSTOP) inside its wide step keeps the lock: one step waits the
    deadline, the next ones only try, until the lock is free again."""
    monkeypatch.setattr(cpu_lending, "ACQUIRE_DEADLINE_S", 0.2)
    holder = _hold(tmp_path / "wide.lock", "EX")
    a = Worker(tmp_path)
    try:
        start = time.perf_counter()
        assert a.step() == 1
        assert time.perf_counter() - start >= 0.2
        start = time.perf_counter()
        assert [a.step() for _ in range(5)] == [1] * 5
        assert time.perf_counter() - start < 0.2  # no more waiting
        assert a.lending.missed == 6
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        assert a.step() == 2 and a.lending.missed == 6  # free again: back to normal
        a.work = False
        assert a.step() == 2  # and a is idle after it
        b = Worker(tmp_path)
        b.lending.__enter__()  # a wide step of a neighbour that is not stuck: waited for again
        assert torch.get_num_threads() == 2
        timer = threading.Timer(0.1, b.lending.__exit__, args=(None, None, None))
        timer.start()
        a.work = True
        start = time.perf_counter()
        assert a.step() == 1 and a.lending.missed == 6
        assert time.perf_counter() - start >= 0.05
        timer.join()
        b.lending.close()
    finally:
        holder.kill()
        holder.wait(timeout=10)
        a.lending.close()
