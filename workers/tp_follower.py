"""A tensor-parallel engine's rank 1..N-1 (workers/tp_group.py): its shard of the model and KV
cache, and a loop that runs each forward pass rank 0 broadcasts, until rank 0 says stop or
goes away.

    python -m pdserve.workers.tp_follower '<json: spec, rank, size, store_port, parent>'
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from pdserve.kernels import cpu_decode
from pdserve.kernels.backend_choice import AttentionBackend
from pdserve.workers import cuda_graphs, memory_plan
from pdserve.workers.buffers import InputBuffers
from pdserve.workers.kv import shared_cache
from pdserve.workers.kv.cache import allocate_kv_caches
from pdserve.workers.kv.cache_manager import KVCacheManager
from pdserve.workers.kv.cuda_ipc import export_cache, ipc_key
from pdserve.workers.memory_plan import CudaMemoryProbe, MemoryProbe, ProfileShape
from pdserve.workers.model.compiled import compile_forward
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.llama import LlamaForCausalLM
from pdserve.workers.model.loader import load_model, resolve_dtype
from pdserve.workers.model.shm_collectives import ShmCollectives
from pdserve.workers.model.tensor_parallel import TensorParallel, shard_config
from pdserve.workers.model_runner import SCORE_ROWS, HostStep, ModelRunner
from pdserve.workers.tp_devices import group_backend, rank_device
from pdserve.workers.tp_group import (
    _IDLE_LIMIT,
    HEADER,
    INLINE,
    FollowerSpec,
    Op,
    Plan,
    StepInputs,
    exchange_memory,
    joining_key,
    logit_calls,
    needs_second,
    unpack_step,
)

log = logging.getLogger("pdserve.tp_follower")
_PARENT_POLL_S = 1.0


def _exit_with_parent(parent: int) -> None:
    """A follower outlives no engine: when rank 0's process is gone, so is this one (its next
    broadcast would otherwise wait for ever)."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent:
            os._exit(0)


def measure_rank(shape: ProfileShape, probe: MemoryProbe | None, model: LlamaForCausalLM, dtype: torch.dtype,
                 device: torch.device, max_model_len: int) -> None:
    """This rank's part of the memory plan: the profile steps rank 0 runs, on this rank's shard and
    device (their collectives pair up with rank 0's), then what it measured, to every rank."""
    if probe is None:
        raise RuntimeError(f"tensor parallel: rank 0 plans from measured memory, and {device} has no memory probe")
    exchange_memory(memory_plan.measure(shape, probe, model, None, dtype, device, max_model_len))


def stage_step(b: InputBuffers, s: StepInputs) -> HostStep:
    """Write a step's inputs into the runner's host buffers, as rank 0's `_fill` did (block-table
    columns past the step's longest sequence are left as they are: attention never reads them)."""
    t, n = s.input_ids.numel(), s.seq_lens.numel()
    b.begin_step()
    b.input_ids.np[:t] = s.input_ids.numpy()
    b.positions.np[:t] = s.positions.numpy()
    b.slot_mapping.np[:t] = s.slot_mapping.numpy()
    b.block_tables.np[:n, : s.block_tables.shape[1]] = s.block_tables.numpy()
    b.seq_lens.np[:n] = s.seq_lens.numpy()
    b.logits_indices.np[: s.logits_indices.numel()] = s.logits_indices.numpy()
    qsl = s.query_start_loc.numpy()
    b.query_start_loc.np[: n + 1] = qsl
    max_rows = int(np.diff(qsl).max()) if n else 0
    return HostStep(t, n, s.num_decode, s.logit_rows, [], max_rows)


def follow_steps(runner: ModelRunner, rank: int) -> None:
    """Run each step rank 0 broadcasts, its forward (eager or the CUDA graph it names) and its
    logits calls, until rank 0 says stop."""
    first = torch.zeros(HEADER + INLINE, dtype=torch.int64)
    with torch.inference_mode():
        while True:
            dist.broadcast(first, 0)
            if int(first[0]) == Op.STOP:
                return
            rest = None
            if n := needs_second(first):
                rest = torch.empty(n, dtype=torch.int64)
                dist.broadcast(rest, 0)
            s = unpack_step(first, rest)
            bucket = None
            if s.graph is not None:
                if runner.graphs is None:
                    raise RuntimeError(f"tensor parallel: rank 0 replays a CUDA graph, rank {rank} has none")
                bucket = runner.graphs.bucket(*s.graph)
            step = stage_step(runner.buf, s)
            # Staged with the step's inputs (pinned on a GPU): no host sync between the forward
            # pass and the logits' gather, as on rank 0.
            idx = runner.buf.logits_indices.to_device(s.logits_indices.numel())
            hidden = runner.forward_step(step, bucket)
            for lo, hi in logit_calls(s.logit_rows, s.prompt_counts, SCORE_ROWS):
                runner.model.compute_logits(hidden[idx[lo:hi]])


def run(spec: FollowerSpec, rank: int, size: int, store_port: int) -> None:
    shm = None
    if spec.shm_path is not None:  # mapped before joining: rank 0 unlinks the file once all joined
        shm = ShmCollectives(spec.shm_path, size, rank, spec.shm_slot_bytes)
    store = dist.TCPStore(  # type: ignore[attr-defined]  # public, but exported behind is_available()
        "127.0.0.1", store_port, size, is_master=False, timeout=_IDLE_LIMIT)
    device = rank_device(torch.device(spec.device), rank)
    if device.type == "cuda":  # before the first collective: NCCL binds each rank to the current device
        torch.cuda.set_device(device)
    store.set(joining_key(rank), "1")  # rank 0 waits for these, watching that each follower lives
    dist.init_process_group(group_backend(device), store=store, rank=rank, world_size=size, timeout=_IDLE_LIMIT)
    tp = TensorParallel(size, rank, shm=shm)
    dtype = resolve_dtype(spec.dtype)
    backend = AttentionBackend(spec.backend)
    torch.manual_seed(spec.seed)
    full = ModelConfig.from_pretrained(spec.model_dir)
    # What others use of this rank's device, read before it holds anything (as rank 0's probe).
    probe = CudaMemoryProbe(device) if spec.measure and device.type == "cuda" else None
    model = load_model(spec.model_dir, full, dtype, device, backend, spec.max_positions,
                       quantization=spec.quantization, tp=tp)
    if spec.measure:
        measure_rank(ProfileShape.decode(spec.shape), probe, model, dtype, device, spec.max_positions)
    plan_msg = torch.zeros(HEADER, dtype=torch.int64)
    dist.broadcast(plan_msg, 0)
    plan = Plan.decode(plan_msg)
    kv_dtype = torch.float8_e4m3fn if spec.kv_cache_dtype in ("fp8", "fp8_e4m3") else dtype
    if plan.shared_kv and spec.kv_path is not None:  # rank 0 reads and writes it for KV transfers
        kv_caches = shared_cache.map_part(spec.kv_path, full, tp, plan.num_kv_blocks, spec.block_size, kv_dtype)
        dist.barrier()  # mapped: rank 0 may remove the file
    else:
        kv_caches = allocate_kv_caches(shard_config(full, tp), plan.num_kv_blocks, spec.block_size, kv_dtype, device)
        if device.type == "cuda":  # rank 0 opens it for the worker's KV transfers (workers/kv/cuda_ipc.py)
            store.set(ipc_key(rank), export_cache(kv_caches))  # type: ignore[arg-type]  # bytes are taken as they are
    if plan.thread_counts:
        torch.set_num_threads(plan.thread_counts[0])
    if device.type == "cpu" and backend is AttentionBackend.TORCH and cpu_decode.enabled():
        cpu_decode.load()  # now, as rank 0 does, not in the first decode step (a first build takes ~20 s)
    shape = ProfileShape.decode(spec.shape)
    # The runner rank 0 steps with, over this rank's shard: the same input buffers (made outside
    # inference mode, as dynamo's guards on a compiled forward want), the same eager and replayed
    # paths. It never schedules: no request's blocks are looked up here.
    max_model_len = plan.max_model_len or spec.max_positions
    runner = ModelRunner(model, kv_caches, KVCacheManager(1, spec.block_size, enable_prefix_caching=False),
                         spec.max_num_batched_tokens, shape.max_num_seqs, max_model_len, device)
    if plan.compile:  # the same warm-up as rank 0's: the same collectives, in the same order
        compiled = compile_forward(model, backend, kv_caches, spec.block_size,
                                   min(spec.max_num_batched_tokens, max_model_len), device,
                                   lambda msg: None, plan.thread_counts, fallback=False)
        if compiled is not None:
            runner.forward = compiled
    if plan.graphs:  # rank 0's buckets, warm-up and captures, collective for collective
        runner.graphs = cuda_graphs.capture(shape, runner, backend, fallback=False)
        if runner.graphs is None:
            raise RuntimeError(f"tensor parallel: rank 0 replays CUDA graphs, and rank {rank} on {device} "
                               "captured none")
    follow_steps(runner, rank)
    dist.destroy_process_group()


def main() -> None:
    args = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.WARNING, format=f"tp rank {args['rank']}: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(int(args["parent"]),), daemon=True,
                     name="tp-parent-watch").start()
    run(FollowerSpec(**args["spec"]), int(args["rank"]), int(args["size"]), int(args["store_port"]))
    # Stopped cleanly: leave without the interpreter's teardown of torch, which took 1-2 s on a
    # busy 2-core machine, all of it in rank 0's close() (it waits for this exit). Nothing here
    # needs it: rank 0 removes the shared files, the OS the mappings; only the logs want flushing.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
