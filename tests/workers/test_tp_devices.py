"""Tensor-parallel ranks on GPUs, what of it runs on CPU: where each rank runs, which backend its
group uses, what a worker of N ranks asks Ray for, and the memory plan per rank (every rank
runs the profile steps on its own device, the pool is planned from the tightest). The NCCL path
itself has not run: no machine with two GPUs has been lent (docs/tensor-parallel.md)."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import tiny_spec
from spawned_ranks import spawn_ranks
from test_memory_plan import FakeProbe, MiB

from pdserve.kernels.backend_choice import AttentionBackend
from pdserve.workers import cuda_graphs, engine_setup, memory_plan, tp_devices, tp_group
from pdserve.workers.config import EngineConfig, SpeculativeMethod
from pdserve.workers.kv.cache import DeviceMemory, kv_budget_bytes, tightest
from pdserve.workers.memory_plan import ProfileShape
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.tiny.builder import Arch, TinyModelSpec

CPU = torch.device("cpu")


@pytest.mark.parametrize(("device", "rank", "want"), [
    ("cuda", 0, "cuda:0"), ("cuda", 3, "cuda:3"), ("cuda:2", 1, "cuda:3"), ("cpu", 1, "cpu"), ("cpu", 0, "cpu")])
def test_rank_r_runs_on_the_r_th_gpu_after_rank_0s(device: str, rank: int, want: str) -> None:
    """Ray lists a worker's N GPUs in its CUDA_VISIBLE_DEVICES, and the followers inherit it: rank r
    of an engine on `cuda` takes the r-th; on CPU every rank is `cpu`."""
    assert tp_devices.rank_device(torch.device(device), rank) == torch.device(want)


def test_too_few_gpus_for_the_ranks_is_a_clear_error_before_anything_starts(
        make_model: Callable[[TinyModelSpec], Path]) -> None:
    tp_devices.check_rank_devices(torch.device("cuda"), 2, 2)
    tp_devices.check_rank_devices(CPU, 8, 0)  # CPU ranks need no GPU
    with pytest.raises(ValueError, match=r"2 ranks from cuda:1 need GPUs cuda:1..cuda:2, and this process sees 2"):
        tp_devices.check_rank_devices(torch.device("cuda:1"), 2, 2)
    # The engine checks it before it starts a follower (this machine sees no GPU).
    model_dir = str(make_model(tiny_spec(Arch.LLAMA, num_heads=4, num_kv_heads=2)))
    with pytest.raises(ValueError, match="this process sees 0"):
        engine_setup.start_tp_group(EngineConfig(model=model_dir, tensor_parallel_size=2),
                                    ModelConfig.from_pretrained(model_dir), model_dir, torch.float32,
                                    torch.device("cuda"), AttentionBackend.TRITON, 128, None)


def test_gpu_ranks_reduce_over_nccl_and_send_their_steps_over_gloo() -> None:
    """One group, two backends: each collective goes by its tensor's device, so the step messages
    (host tensors) stay on gloo and the model's all-reduces (CUDA tensors) go to NCCL."""
    assert tp_devices.group_backend(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"
    assert tp_devices.group_backend(CPU) == "gloo"


@pytest.mark.parametrize("measures", [True, False])
def test_a_gpu_engine_starts_its_ranks_without_host_collectives_and_with_the_profile(
        measures: bool, make_model: Callable[[TinyModelSpec], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """What rank 0 tells its followers on GPUs (the group itself stood in for): its device, no
    shared-memory collectives (they take host tensors), the profile steps' settings where the pool
    is sized from measured memory; and rank 0 on the first of the ranks' GPUs."""
    model_dir = str(make_model(tiny_spec(Arch.LLAMA, num_heads=4, num_kv_heads=2)))
    started: list[tuple[int, tp_group.FollowerSpec]] = []
    current: list[torch.device] = []
    monkeypatch.setattr(engine_setup.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(engine_setup.torch.cuda, "set_device", current.append)
    monkeypatch.setattr(engine_setup, "TPGroup", lambda size, spec: started.append((size, spec)) or "group")
    config = EngineConfig(model=model_dir, tensor_parallel_size=2, speculative=SpeculativeMethod.NGRAM,
                          num_speculative_tokens=3, max_num_seqs=8)
    assert engine_setup.start_tp_group(config, ModelConfig.from_pretrained(model_dir), model_dir, torch.float16,
                                       torch.device("cuda"), AttentionBackend.TRITON, 128, None, measures) == "group"
    (size, spec), = started
    assert (size, spec.device, spec.shm_slot_bytes, current) == (2, "cuda", 0, [torch.device("cuda", 0)])
    assert (spec.shape, spec.measure) == (ProfileShape.of(config).encode(), measures)
    assert ProfileShape.decode(spec.shape).num_speculative_tokens == 3  # verify steps and buckets alike
    assert tp_group.shared_kv_path(torch.device("cuda")) is None  # a GPU rank's KV is its own device's
    assert tp_group.shared_kv_path(CPU) is not None or not tp_group.shm_collectives.supported()


def test_ranks_replay_the_graph_rank_0_names(make_model: Callable[[TinyModelSpec], Path],
                                             monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """CUDA graphs with the all-reduce inside, on CPU's stand-in graphs: rank 0 and its follower (a
    process of its own, tp_follower's code) capture the same buckets with the same warm-up, each
    step's message names the bucket rank 0 replays and the follower replays its own, padding
    included; the tokens and logprobs are one eager rank's. Through gloo, as NCCL, which (unlike
    the shared-memory rounds) fail when the ranks reduce tensors of different sizes."""
    from test_cuda_graphs import SPEC, FakeGraph, assert_same, make_llm, prompts, run

    from pdserve.workers.model import shm_collectives

    model_dir = make_model(SPEC)
    want = run(make_llm(model_dir, enforce_eager=True), prompts(3))
    replay_log = tmp_path / "replays"
    monkeypatch.setenv("PDSERVE_TEST_REPLAY_LOG", str(replay_log))
    monkeypatch.setattr(shm_collectives, "supported", lambda: False)
    monkeypatch.setattr(cuda_graphs, "wanted", lambda *args: True)
    monkeypatch.setattr(cuda_graphs, "capture", functools.partial(cuda_graphs.capture, graph_factory=FakeGraph))
    popen = subprocess.Popen

    def follower_with_stand_ins(args: list[str], **kwargs: Any) -> Any:
        if args[1:3] == ["-m", "pdserve.workers.tp_follower"]:
            args = [args[0], str(Path(__file__).with_name("graph_follower_proc.py")), *args[3:]]
        return popen(args, **kwargs)

    monkeypatch.setattr(tp_group.subprocess, "Popen", follower_with_stand_ins)
    llm = make_llm(model_dir, tensor_parallel_size=2, enforce_eager=False)
    try:
        graphs = llm.engine.runner.graphs
        assert graphs is not None
        assert_same(run(llm, prompts(3)), want)
        replayed = [b.seqs for b in graphs.decode if b.replays]
        assert replayed and max(replayed) > 1  # batches padded up to their bucket, on both ranks
        by_bucket = {f"{b.seqs}x{b.rows}": b.replays for b in graphs.decode + graphs.verify if b.replays}
        assert collections.Counter(replay_log.read_text().split()) == by_bucket  # the follower's, the same
    finally:
        llm.close()


def test_a_step_message_names_the_graph_that_runs_it() -> None:
    three = torch.arange(3)
    inputs = tp_group.StepInputs(three, three, three, torch.zeros(3, 1, dtype=torch.int32),
                                 torch.ones(3, dtype=torch.int32), torch.arange(4, dtype=torch.int32), 3, three, 3, [],
                                 graph=(4, 1))
    first = torch.zeros(tp_group.HEADER + tp_group.INLINE, dtype=torch.int64)
    assert tp_group.pack_step(inputs, first) is None
    assert tp_group.unpack_step(first, None).graph == (4, 1)
    assert tp_group.unpack_step(first, None).input_ids.tolist() == [0, 1, 2]
    assert tp_group.pack_step(dataclasses.replace(inputs, graph=None), first) is None
    assert tp_group.unpack_step(first, None).graph is None
    plan = tp_group.Plan(64, True, (2, 1), shared_kv=True, graphs=True, max_model_len=640)
    assert tp_group.Plan.decode(plan.encode()) == plan


def test_a_gpu_ranks_cache_is_shared_as_its_one_allocation() -> None:
    """What a follower exports over CUDA IPC is the one tensor under its cache (allocate_kv_caches's
    layout); a cache of other tensors, or one in host memory, is refused by name."""
    from pdserve.workers.kv import cuda_ipc

    full = torch.zeros(3, 2, 8, 4, 2, 16)
    caches = [(full[i, 0], full[i, 1]) for i in range(3)]
    assert cuda_ipc.whole(caches) is full
    with pytest.raises(ValueError, match="only a CUDA cache"):
        cuda_ipc.export_cache(caches)
    with pytest.raises(ValueError, match="not one allocation"):
        cuda_ipc.whole([(torch.zeros(8, 4, 2, 16), torch.zeros(8, 4, 2, 16))])
    with pytest.raises(ValueError, match="not one allocation"):
        cuda_ipc.whole(caches[:2])
    assert cuda_ipc.ipc_key(1) != cuda_ipc.ipc_key(2) != tp_group.joining_key(2)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_gone_or_stopped_follower_aborts_nccl_at_once(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On GPUs a collective waits in NCCL for a gone peer without end (until torch's watchdog ends
    the process): the watch aborts NCCL as soon as a follower exited or stayed stopped past the
    grace, whether or not rank 0 waits in gloo; a closed group (a normal stop) is not aborted."""
    monkeypatch.setattr(tp_group, "STOPPED_GRACE_S", 0.5)
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    aborted, quiet = threading.Event(), threading.Event()
    watch = tp_group._StoppedWatch([procs[0]], abort=aborted.set)
    closed = tp_group._StoppedWatch([procs[1]], abort=quiet.set)
    try:
        time.sleep(1.2)
        assert not aborted.is_set()
        closed.closed = True
        for p in procs:
            if how == "killed":
                p.kill()
            else:
                os.kill(p.pid, signal.SIGSTOP)
        assert aborted.wait(5)
        time.sleep(1.5)
        assert not quiet.is_set()
    finally:
        watch.closed = closed.closed = True
        for p in procs:
            p.kill()
            p.wait(10)


def test_the_pool_is_planned_from_the_rank_that_has_least_room() -> None:
    """Every rank holds as many blocks: the rank whose device leaves the least is the plan."""
    roomy = DeviceMemory(total=80 * MiB, used_by_others=2 * MiB, weights=20 * MiB, activations=4 * MiB)
    shared = DeviceMemory(total=80 * MiB, used_by_others=30 * MiB, weights=20 * MiB, activations=4 * MiB)
    assert tightest([roomy, shared, roomy], 0.9) is shared
    assert kv_budget_bytes(shared, 0.9) == int(72 * MiB) - 54 * MiB
    with pytest.raises(ValueError, match="no rank"):
        tightest([], 0.9)


def test_profile_settings_cross_to_a_follower_as_json() -> None:
    import json

    for config in (EngineConfig(model="tiny"), EngineConfig(model="tiny", speculative=SpeculativeMethod.NGRAM,
                                                            enforce_eager=True, max_num_seqs=3)):
        shape = ProfileShape.of(config)
        assert ProfileShape.decode(json.loads(json.dumps(shape.encode()))) == shape
        assert memory_plan.profile_tokens(shape, 512, 2) == memory_plan.profile_tokens(config, 512, 2)


# --- every rank measures, in step --------------------------------------------------------------

_SHAPE = ProfileShape(max_num_seqs=4, max_num_batched_tokens=64, block_size=16, num_speculative_tokens=2,
                      speculative=SpeculativeMethod.NGRAM, enforce_eager=True)
_MAX_LEN = 128
# Rank 1's device is shared with another process (24 MiB in use before the engine): the tightest.
_FIGURES = [dict(total=64 * MiB, used_at_start=16 * MiB, weights=8 * MiB, activations=4 * MiB),
            dict(total=64 * MiB, used_at_start=24 * MiB, weights=8 * MiB, activations=4 * MiB, non_torch=MiB)]
_TIMEOUT_S = 120


def _measure_on_rank(rank: int, port: int, results: Any, model_dir: str) -> None:
    """Rank 0 as the engine plans (its profile, then the tightest of every rank's memory); rank 1 as
    a follower does (tp_follower.measure_rank), each on its shard with its device's (fake) probe."""
    import torch.distributed as dist

    from pdserve.workers.model.loader import load_model
    from pdserve.workers.model.tensor_parallel import TensorParallel
    from pdserve.workers.tp_follower import measure_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=_TIMEOUT_S // 2))
    try:
        tp = TensorParallel(2, rank)
        model = load_model(model_dir, ModelConfig.from_pretrained(model_dir), torch.float32, CPU,
                           AttentionBackend.TORCH, _MAX_LEN, tp=tp)
        probe = FakeProbe(**_FIGURES[rank])
        if rank == 0:
            mine = memory_plan.measure(_SHAPE, probe, model, None, torch.float32, CPU, _MAX_LEN)
            results.put((rank, probe.peaks, tightest(tp_group.exchange_memory(mine), 0.9)))
        else:
            measure_rank(_SHAPE, probe, model, torch.float32, CPU, _MAX_LEN)
            results.put((rank, probe.peaks, None))
    finally:
        dist.destroy_process_group()


def test_every_rank_runs_the_profile_in_step_and_the_tightest_plans(
        make_model: Callable[[TinyModelSpec], Path]) -> None:
    """The profile steps of rank 0 and a follower pair up collective for collective (their prefill
    and verify steps, each with its all-reduces and logits gather, on two processes over gloo);
    then every rank's measured memory reaches rank 0, which plans from the rank with least room."""
    model_dir = str(make_model(tiny_spec(Arch.LLAMA, num_heads=4, num_kv_heads=2)))
    got = spawn_ranks(_measure_on_rank, 2, _TIMEOUT_S, model_dir)  # fails the test at the deadline
    assert got[0][0] == got[1][0] == 2  # each rank measured a prefill and a verify step
    assert got[0][1] == DeviceMemory(total=64 * MiB, used_by_others=24 * MiB, weights=8 * MiB,
                                     activations=4 * MiB, non_torch=MiB)
