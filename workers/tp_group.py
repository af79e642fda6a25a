"""A tensor-parallel engine's ranks: rank 0 is the engine (scheduler, sampler, everything the
host does); ranks 1..N-1 are processes it starts (workers/tp_follower.py), each holding its
shard of the model and of the KV cache. They run every forward pass rank 0 runs, on the step
inputs rank 0 broadcasts, and take part in its collectives (the all-reduces of each layer, the
logits' gather). The scheduler runs once; a follower never decides anything.

One broadcast a step (`send_step`): a fixed-size int64 message holding a header and, when the
step fits (decode steps of moderate batches), its inputs inline; a larger step sends its
inputs in a second broadcast. Step inputs, not requests: a follower needs no tokenizer, no
scheduler, no KV manager: the block tables say where every token's K and V go.

The group is torch.distributed's default group (gloo on CPU; on GPUs gloo for the step messages
and NCCL for the model's collectives, rank r on the r-th GPU: workers/tp_devices.py): one
tensor-parallel engine per process. When the caller initialised torch.distributed itself
(torchrun), there are no followers: every rank runs a whole engine on the same requests
(tensor_parallel.TensorParallel.from_world).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pdserve.workers.kv import shared_cache
from pdserve.workers.kv.cache import DeviceMemory, tightest
from pdserve.workers.kv.cuda_ipc import import_cache, ipc_key
from pdserve.workers.kv.shared_cache import KVCaches, ShardedKV
from pdserve.workers.model import shm_collectives
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.shm_collectives import ShmCollectives
from pdserve.workers.model.tensor_parallel import TensorParallel
from pdserve.workers.tp_devices import group_backend

# int64 words of a step message: the header, then inline inputs.
HEADER = 16
INLINE = 4096
# How long rank 0 waits for its followers to join; a collective's own limit is long, because a
# follower waits in one (the next step's broadcast) for as long as the engine is idle.
JOIN_TIMEOUT_S = 120.0
_IDLE_LIMIT = datetime.timedelta(days=365)


_running = {"group": False}  # whether a TPGroup of this process holds the default group


def tp_group_running() -> bool:
    """Whether torch.distributed's default group here is a TPGroup's (not a torchrun's)."""
    return _running["group"]


class TPGroupError(RuntimeError):
    """The tensor-parallel group cannot run another step (a rank is gone, or a step failed part
    way, which may leave the ranks' collectives out of step): the engine is done, and its
    worker is restarted whole."""


class Op(IntEnum):
    STOP = 0
    STEP = 1


log = logging.getLogger(__name__)

@dataclass(frozen=True)
class FollowerSpec:
    """What a follower builds its shard from (plain data: it crosses a process start as JSON)."""

    model_dir: str
    dtype: str  # "float32", "float16", "bfloat16"
    device: str  # rank 0's: rank r runs on its r-th neighbour (tp_devices.rank_device)
    backend: str  # AttentionBackend value
    max_positions: int
    quantization: str | None
    kv_cache_dtype: str
    block_size: int
    max_num_batched_tokens: int
    seed: int
    shm_path: str | None = None  # the ranks' shared-memory collectives (None: gloo's)
    shm_slot_bytes: int = 0
    # Where the ranks' KV caches will lie (workers/kv/shared_cache.py), made by rank 0 once it
    # sized the pool; the plan says whether it did.
    kv_path: str | None = None
    # The engine's step shape (memory_plan.ProfileShape.encode()): what the profile steps and the
    # CUDA graphs' buckets follow, alike on every rank.
    shape: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Rank 0 sizes the KV pool from measured memory (GPUs): each rank runs the profile steps and
    # measures its own device (`exchange_memory`).
    measure: bool = False


@dataclass(frozen=True)
class Plan:
    """What rank 0 decided after loading: the KV pool, and whether (and at which thread
    counts) the forward is compiled: the followers' warm-up runs the same collectives."""

    num_kv_blocks: int
    compile: bool
    thread_counts: tuple[int, ...]
    shared_kv: bool = False  # the KV caches lie in the spec's `kv_path` (else each rank's own)
    # Decode steps replay CUDA graphs (workers/cuda_graphs.py): every rank captures the same buckets,
    # in the same order, with the same warm-up.
    graphs: bool = False
    # The context the engine serves, which the plan may have lowered from the spec's (a KV pool
    # that cannot hold the model's own): a follower's runner sizes its block tables by it, as rank
    # 0's does (a CUDA graph's host plans are bounded by their width). 0: the spec's.
    max_model_len: int = 0

    def encode(self) -> torch.Tensor:
        words = [self.num_kv_blocks, int(self.compile), int(self.shared_kv), int(self.graphs), self.max_model_len,
                 len(self.thread_counts), *self.thread_counts]
        out = torch.zeros(HEADER, dtype=torch.int64)
        out[: len(words)] = torch.tensor(words, dtype=torch.int64)
        return out

    @classmethod
    def decode(cls, t: torch.Tensor) -> Plan:
        w = t.tolist()
        return cls(int(w[0]), bool(w[1]), tuple(int(x) for x in w[6 : 6 + int(w[5])]), bool(w[2]), bool(w[3]),
                   int(w[4]))


@dataclass
class StepInputs:
    """A step's model inputs, as a follower rebuilds them."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, cols] int32 (cols: the blocks of the step's longest sequence)
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    num_decode: int
    logits_indices: torch.Tensor  # [rows] int64: the hidden rows the step's logits read
    logit_rows: int  # sampled and verified rows (the first of logits_indices)
    prompt_counts: list[int]  # prompt-logprob rows per request, after them
    # The CUDA graph rank 0 replays the step from, as (sequences, rows) of its bucket (None: eager):
    # every rank replays its own graph of that bucket, whose collectives pair with rank 0's.
    graph: tuple[int, int] | None = None


def logit_calls(logit_rows: int, prompt_counts: list[int], slice_rows: int) -> list[tuple[int, int]]:
    """The step's compute_logits calls, in order, as [lo, hi) ranges of its logits rows: each
    request's prompt-logprob rows in slices of `slice_rows`, then the sampled and verified rows.
    Each call gathers the vocabulary over the ranks, so both sides make the same calls."""
    calls, at = [], logit_rows
    for count in prompt_counts:
        calls += [(at + lo, at + min(count, lo + slice_rows)) for lo in range(0, count, slice_rows)]
        at += count
    if logit_rows:
        calls.append((0, logit_rows))
    return calls


def pack_step(s: StepInputs, first: torch.Tensor) -> torch.Tensor | None:
    """Write the first message (header + inline inputs) into `first` (HEADER + INLINE int64
    words, reused every step); return the second message, or None when the inputs fit inline."""
    t, n_seqs = s.input_ids.numel(), s.seq_lens.numel()
    cols = s.block_tables.shape[1] if n_seqs else 0
    parts = [p.to(torch.int64).reshape(-1) for p in (
        s.input_ids, s.positions, s.slot_mapping, s.block_tables, s.seq_lens, s.query_start_loc, s.logits_indices,
        torch.tensor(s.prompt_counts, dtype=torch.int64))]
    n = sum(p.numel() for p in parts)
    graph = s.graph or (0, 0)
    header = [Op.STEP, t, n_seqs, cols, s.num_decode, s.logits_indices.numel(), s.logit_rows, len(s.prompt_counts), n,
              *graph]
    first[: len(header)] = torch.tensor(header, dtype=torch.int64)
    if n <= INLINE:
        torch.cat(parts, out=first[HEADER : HEADER + n])
        return None
    return torch.cat(parts)


def unpack_step(first: torch.Tensor, rest: torch.Tensor | None) -> StepInputs:
    h = first[:HEADER].tolist()
    t, n_seqs, cols, num_decode, rows, logit_rows, n_counts, n, graph_seqs, graph_rows = (int(x) for x in h[1:11])
    payload = first[HEADER : HEADER + n] if rest is None else rest
    sizes = [t, t, t, n_seqs * cols, n_seqs, n_seqs + 1, rows, n_counts]
    ids, pos, slots, tables, lens, qsl, idx, counts = torch.split(payload, sizes)
    return StepInputs(ids.clone(), pos.clone(), slots.clone(), tables.reshape(n_seqs, cols).to(torch.int32),
                      lens.to(torch.int32), qsl.to(torch.int32), num_decode, idx.clone(), logit_rows,
                      [int(c) for c in counts], (graph_seqs, graph_rows) if graph_seqs else None)


def needs_second(first: torch.Tensor) -> int:
    """Words of the second message (0: none)."""
    n = int(first[8])
    return n if n > INLINE else 0


class TPGroup:
    """Rank 0's side: starts the followers, joins the group with them, then sends each step."""

    def __init__(self, size: int, spec: FollowerSpec, say: object = None) -> None:
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size: torch.distributed is already initialised in this process: "
                             "one tensor-parallel engine per process (under torchrun every rank runs its own)")
        if tp_group_running():
            raise ValueError("tensor_parallel_size: this process's tensor-parallel group is still up (close() the "
                             "engine that started it first): one tensor-parallel engine per process")
        # Rank 0's store listens on a port the kernel picks and holds from here on: a port probed
        # free and bound later can be taken in between (another group, Serve, HAProxy starting).
        timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
        store = dist.TCPStore(  # type: ignore[attr-defined]  # public, but exported behind is_available()
            "127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
        shm = None
        self.procs: list[subprocess.Popen[bytes]] = []
        path = shm_collectives.create(size, spec.shm_slot_bytes) if spec.shm_slot_bytes else None
        spec = dataclasses.replace(spec, kv_path=shared_kv_path(torch.device(spec.device)))
        self.spec = spec
        try:
            if path is not None:
                spec = dataclasses.replace(spec, shm_path=path)
                shm = ShmCollectives(path, size, 0, spec.shm_slot_bytes)
            for rank in range(1, size):
                args = json.dumps({"spec": asdict(spec), "rank": rank, "size": size, "store_port": store.port,
                                   "parent": os.getpid()})
                self.procs.append(subprocess.Popen([sys.executable, "-m", "pdserve.workers.tp_follower", args]))
            _wait_for_keys(store, [joining_key(rank) for rank in range(1, size)], self.procs, "started")
            dist.init_process_group(group_backend(torch.device(spec.device)), store=store, rank=0, world_size=size,
                                    timeout=timeout)
        except BaseException:
            _kill(self.procs)
            _stop(self.procs)
            raise
        finally:
            if path is not None:  # every rank mapped it before joining (or failed): no file outlives the ranks
                shm_collectives.unlink(path)
        self._store = store
        self._device_kv: ShardedKV | None = None
        self._device_kv_lock = threading.Lock()
        _running["group"] = True
        if shm is not None:
            shm.alive = _Followers(self.procs).alive
        self._watch = _StoppedWatch(self.procs, _abort_nccl if torch.device(spec.device).type == "cuda" else None)
        self.tp = TensorParallel(size, 0, shm=shm)
        self._first = torch.zeros(HEADER + INLINE, dtype=torch.int64)  # each step's first message
        self.broken: BaseException | None = None  # why the group can run no more steps
        self.steps = 0
        self.messages = 0  # broadcasts of step inputs (beyond the model's own collectives)
        # Whether the followers are in their step loop (they took the plan): only then do they
        # read a stop message; before it they are killed (an engine that failed to start).
        self._state: dict[str, object] = {"planned": False, "broken": False, "watch": self._watch}
        self._finalizer = weakref.finalize(self, _close, self.procs, self._state)

    def share_kv(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> ShardedKV | None:
        """Every rank's KV cache in one shared file (workers/kv/shared_cache.py), rank 0's view of
        them all; None where there is no room for it (then each rank allocates its own)."""
        path = self.spec.kv_path
        if path is None or not shared_cache.reserve(path, cfg, self.tp.size, num_blocks, block_size, dtype):
            return None
        self._state["kv_path"] = path  # removed once the followers mapped it, or at close
        try:
            return ShardedKV.map(path, cfg, self.tp.size, num_blocks, block_size, dtype)
        except BaseException:
            shm_collectives.unlink(path)
            raise

    def device_kv(self, own: KVCaches, cfg: ModelConfig) -> ShardedKV:
        """GPU ranks' caches as the full model's heads, from here: rank 0's `own`, and each
        follower's opened over CUDA IPC (workers/kv/cuda_ipc.py) on first call, once all have set
        theirs in the store (each does once it allocated it)."""
        with self._device_kv_lock:
            if self._device_kv is None:
                keys = [ipc_key(rank) for rank in range(1, self.tp.size)]
                _wait_for_keys(self._store, keys, self.procs, "shared their KV caches")
                self._device_kv = ShardedKV.of_ranks([own, *(import_cache(self._store.get(k)) for k in keys)], cfg)
            return self._device_kv

    def tightest_memory(self, mine: DeviceMemory, gpu_memory_utilization: float) -> DeviceMemory:
        """What the KV pool is planned from: of every rank's measured memory (each followed rank 0's
        profile steps on its own device), the one that leaves the cache least."""
        return tightest(exchange_memory(mine), gpu_memory_utilization)

    def send_plan(self, plan: Plan) -> None:
        try:
            dist.broadcast(plan.encode(), 0)
            if plan.shared_kv:
                dist.barrier()  # every follower mapped the KV file: it can go (the mappings stay)
        finally:
            if self.spec.kv_path is not None:
                shm_collectives.unlink(self.spec.kv_path)
        self._state["planned"] = True

    def mark_broken(self, error: BaseException) -> None:
        """No more steps: a step failed part way (the followers may wait in a collective)."""
        self.broken = error
        self._state["broken"] = True

    def send_step(self, inputs: StepInputs) -> None:
        rest = pack_step(inputs, self._first)
        self._watch.since = time.monotonic()  # in gloo: a follower stopped meanwhile is the watch's
        try:
            dist.broadcast(self._first, 0)
            self.messages += 1
            if rest is not None:
                dist.broadcast(rest, 0)
                self.messages += 1
        finally:
            self._watch.since = None
        self.steps += 1

    def gone(self, settle_s: float = 0.0) -> list[int]:
        """The ranks whose process exited (killed, crashed). `settle_s`: while none has, how long
        to look again: a rank killed a moment ago closes its sockets (the step fails on that)
        before its exit can be seen, and the error would not name it."""
        deadline = time.monotonic() + settle_s
        while True:
            gone = [rank for rank, p in enumerate(self.procs, start=1) if p.poll() is not None]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.02)

    def close(self) -> None:
        """Stop the followers and leave the group (the process may start another group after)."""
        self._finalizer()


def shared_kv_path(device: torch.device) -> str | None:
    """Where the ranks' KV caches of an engine on `device` may lie in one shared file (made once the
    pool is sized): host memory, so CPU ranks only (a GPU rank's cache is its own device's); None
    where there is none."""
    return shared_cache.new_path() if device.type == "cpu" and shm_collectives.supported() else None


def _close(procs: list[subprocess.Popen[bytes]], state: dict[str, object]) -> None:
    """Stop the followers: a stop message when they are in their step loop and all alive, else
    (an engine that failed to start, a rank gone) kill them; then leave the group."""
    if isinstance(watch := state.get("watch"), _StoppedWatch):
        watch.closed = True
    if isinstance(kv_path := state.get("kv_path"), str):  # an engine that failed before its plan went out
        shm_collectives.unlink(kv_path)
    try:
        if dist.is_initialized():
            try:
                if state["planned"] and not state["broken"] and all(p.poll() is None for p in procs):
                    dist.broadcast(torch.zeros(HEADER + INLINE, dtype=torch.int64), 0)  # Op.STOP
                else:
                    _kill(procs)
            except RuntimeError:  # the group broke (a rank died mid-step): nothing to tell them
                _kill(procs)
            finally:
                dist.destroy_process_group()
                _running["group"] = False
    finally:
        _stop(procs)



# How long a follower may stay stopped (SIGSTOP, a debugger's stop) before rank 0's wait for it
# fails the step: the collectives' own deadline is 10 minutes (ranks compile their warm-up steps
# side by side), and every request on the worker waited that long for a stopped rank.
STOPPED_GRACE_S = 10.0
_STOP_CHECK_S = 1.0  # how often a wait reads the followers' states (a /proc read each)


class _Followers:
    """Whether the followers can still reach a collective: none exited, none stopped for
    longer than STOPPED_GRACE_S. Called from the shared-memory collectives' waits."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self._stopped_since: dict[int, float] = {}
        self._checked = 0.0

    def alive(self) -> bool:
        if any(p.poll() is not None for p in self.procs):
            return False
        now = time.monotonic()
        if now - self._checked < _STOP_CHECK_S:
            return True
        self._checked = now
        for p in self.procs:
            if _stopped(p.pid):
                if now - self._stopped_since.setdefault(p.pid, now) > STOPPED_GRACE_S:
                    return False
            else:
                self._stopped_since.pop(p.pid, None)
        return True


class _StoppedWatch:
    """A wait of rank 0 in gloo (a step's inputs broadcast) cannot be cut short from here, and a
    stopped follower held it for the group's timeout (120 s), where the shared-memory waits give
    up after STOPPED_GRACE_S. So while rank 0 is in gloo (`since`), a follower stopped past the
    grace is killed: the wait fails at once, as a rank that is gone (the group is broken either
    way). Checked once a second by a thread of its own (it holds no reference to the group).

    On GPUs (`abort`: the group's NCCL backend's abort) a follower that exited or stayed stopped
    past the grace aborts NCCL at once, whenever it happens: NCCL's kernels wait for a gone peer
    without end (until torch's watchdog takes the whole process down at the group's timeout),
    where an aborted communicator fails the step that waits in it."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], abort: Callable[[], None] | None = None) -> None:
        self.procs = procs
        self.since: float | None = None  # when rank 0 entered its gloo wait (None: not in one)
        self.closed = False
        self.abort = abort
        self._followers = _Followers(procs)
        threading.Thread(target=self._run, name="pdserve-tp-stopped-watch", daemon=True).start()

    def _run(self) -> None:
        while not self.closed:
            time.sleep(_STOP_CHECK_S)
            alive = self._followers.alive()  # (each call also times how long each has been stopped)
            if self.abort is not None and not alive and not self.closed:
                log.warning("tensor parallel: a rank exited or stayed stopped past %g s: NCCL aborted (the step "
                            "fails)", STOPPED_GRACE_S)
                self.abort()
                return
            if not any(p.poll() is None for p in self.procs):
                return
            if self.since is not None and not alive:
                for p in self.procs:
                    if p.poll() is None and _stopped(p.pid):
                        log.warning("tensor parallel: rank pid %d stopped for over %g s while rank 0 waits on it: "
                                    "killed (the step fails)", p.pid, STOPPED_GRACE_S)
                        p.kill()


def _abort_nccl() -> None:
    """Abort the default group's NCCL communicators: the collectives waiting in them fail."""
    try:
        dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda")).abort()
    except Exception as e:  # noqa: BLE001 - the group is broken either way; the step fails at the timeout
        log.warning("tensor parallel: aborting NCCL failed: %r", e)


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T or t in /proc: a signal's stop or a tracer's)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] in (b"T", b"t")


_MEMORY_WORDS = len(dataclasses.fields(DeviceMemory))


def exchange_memory(mine: DeviceMemory) -> list[DeviceMemory]:
    """Every rank's measured memory, in rank order, on every rank (one gather of int64 words over
    the default group's CPU backend). Called by every rank once, after its profile steps."""
    words = torch.tensor(dataclasses.astuple(mine), dtype=torch.int64)
    parts = [torch.empty(_MEMORY_WORDS, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, words)
    return [DeviceMemory(*(int(w) for w in p.tolist())) for p in parts]


def joining_key(rank: int) -> str:
    """What follower `rank` sets in rank 0's store once it is up, before it joins the group."""
    return f"pdserve/joining/{rank}"


def _wait_for_keys(store: Any, keys: list[str], procs: list[subprocess.Popen[bytes]], what: str) -> None:
    """Wait until the followers set `keys` in the store (`what` they did), for JOIN_TIMEOUT_S at
    most, and fail at once if one exits first: a follower that died starting (OOM-killed importing
    torch, a crash) left rank 0 in the group's rendezvous for the whole JOIN_TIMEOUT_S."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not store.check(keys):
        for rank, p in enumerate(procs, start=1):
            if p.poll() is not None:
                raise RuntimeError(f"tensor parallel: rank {rank} exited with {p.returncode} before it {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"tensor parallel: the followers had not {what} within {JOIN_TIMEOUT_S:g} s")
        time.sleep(0.05)


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()


STOP_WAIT_S = 10.0  # how long a group's followers get to exit, all together


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Wait for the followers to exit within one shared STOP_WAIT_S (each its own 10 s, in turn:
    three hung ones took 30 s, past a whole stop's budget), then kill what is left."""
    deadline = time.monotonic() + STOP_WAIT_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _kill(procs)
    for p in procs:
        p.wait(STOP_WAIT_S)  # killed: gone at once (a SIGKILLed process needs no turn)


def host_block_tables(tables: np.ndarray, seq_lens: np.ndarray, block_size: int) -> torch.Tensor:
    """The block-table columns the step's sequences use (the rest is padding a follower need not get)."""
    cols = int(-(-int(seq_lens.max()) // block_size)) if len(seq_lens) else 0
    return torch.from_numpy(np.ascontiguousarray(tables[: len(seq_lens), :cols]))
