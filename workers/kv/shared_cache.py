"""A tensor-parallel engine's KV cache in one shared-memory file: each rank steps on its part
(its KV heads, laid out as any cache: workers/kv/cache.py), and rank 0 maps every part, so
that a KV transfer reads and writes the whole model's heads from rank 0's process
(`ShardedKV`) with no message to the other ranks.

Why shared memory and not a gather over the ranks' group: transfers run on their own threads
while the engine steps, and the group's collectives belong to the engine thread, in step on
every rank. A rank writes its part only at the slots rank 0 scheduled, so the rules that keep a
transfer's blocks still on one rank (blocks held by a request until they are sent; reserved
blocks untouched until their transfer is DONE) keep them still on every rank. A step's KV is
in every rank's part when rank 0's step returns: each rank writes a layer's KV before that
layer's all-reduce, which rank 0 cannot finish without it.

A prefill worker of p ranks and a decode worker of d ranks then exchange the full heads (the
frames of workers/transfer/frames.py, unchanged on the wire): the sender interleaves its ranks'
heads into each frame, the receiver splits each frame among its own ranks, for any p and d,
replicated KV heads included (a head that several ranks hold is read from one, written to all).

Costs: the pages are the file system's (tmpfs): 4 KiB pages unless the node's shmem THP setting
allows larger, where the private cache gets 2 MiB pages; and the file needs room in /dev/shm
(else the ranks keep private caches and the worker cannot take part in KV transfers).
On GPUs each rank's cache is its own device's memory, and rank 0 opens the others' over CUDA IPC
(workers/kv/cuda_ipc.py): the same `ShardedKV`, its copies device to device (untested on GPUs).
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.workers.model import shm_collectives
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.tensor_parallel import TensorParallel, shard_config

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V): [num_blocks, block_size, kv_heads, head_dim]
_ALIGN = 1 << 21  # each rank's part starts on a 2 MiB boundary


def new_path() -> str:
    """A name for the file, chosen before it exists (the other ranks are told it when they start)."""
    return f"/dev/shm/pdserve-tpkv-{os.getpid()}-{secrets.token_hex(6)}"


def part_bytes(cfg: ModelConfig, tp: TensorParallel, num_blocks: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one rank's part of the file (its cache, rounded up to `_ALIGN`)."""
    shard = shard_config(cfg, tp)
    raw = 2 * shard.num_layers * num_blocks * block_size * shard.num_kv_heads * shard.head_dim * dtype.itemsize
    return -(-raw // _ALIGN) * _ALIGN


def reserve(path: str, cfg: ModelConfig, size: int, num_blocks: int, block_size: int, dtype: torch.dtype) -> bool:
    """Create the file with room for every rank's part; False (a warning logged) where there is none."""
    if not shm_collectives.supported():
        return False
    shm_collectives.sweep_orphans()
    nbytes = size * part_bytes(cfg, TensorParallel(size, 0), num_blocks, block_size, dtype)
    return shm_collectives.reserve(path, nbytes, "the ranks keep private KV caches (no KV transfer)")


def map_part(path: str, cfg: ModelConfig, tp: TensorParallel, num_blocks: int, block_size: int,
             dtype: torch.dtype, raw: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank `tp.rank`'s cache, as views of the shared file (`raw`: the file already mapped; else it is
    mapped whole here: address space, not memory)."""
    part = part_bytes(cfg, tp, num_blocks, block_size, dtype)
    if raw is None:
        raw = torch.from_file(path, shared=True, size=tp.size * part, dtype=torch.uint8)
    shard = shard_config(cfg, tp)
    shape = (shard.num_layers, 2, num_blocks, block_size, shard.num_kv_heads, shard.head_dim)
    mine = raw[tp.rank * part : tp.rank * part + math.prod(shape) * dtype.itemsize]
    full = mine.view(dtype).view(shape)
    return [(full[i, 0], full[i, 1]) for i in range(shard.num_layers)]


@dataclass(frozen=True)
class ShardedKV:
    """Every rank's cache of a tensor-parallel engine, as the full model's KV heads: what its KV
    transfers read and write (workers/transfer/frames.py takes it where it takes a cache)."""

    ranks: tuple[KVCaches, ...]  # rank r's cache: per layer (K, V), its heads only
    heads: tuple[tuple[int, int], ...]  # rank r's (first KV head, KV heads) of the full model
    num_kv_heads: int  # the full model's

    @classmethod
    def map(cls, path: str, cfg: ModelConfig, size: int, num_blocks: int, block_size: int,
            dtype: torch.dtype) -> ShardedKV:
        """Every rank's part of the file at `path` (rank 0's view)."""
        ranks = [TensorParallel(size, r) for r in range(size)]
        raw = torch.from_file(path, shared=True, size=size * part_bytes(cfg, ranks[0], num_blocks, block_size, dtype),
                              dtype=torch.uint8)  # once: every rank's part is a view of it
        return cls(tuple(map_part(path, cfg, tp, num_blocks, block_size, dtype, raw) for tp in ranks),
                   tuple(tp.kv_heads(cfg) for tp in ranks), cfg.num_kv_heads)

    @classmethod
    def of_ranks(cls, caches: Sequence[KVCaches], cfg: ModelConfig) -> ShardedKV:
        """Every rank's cache, given (GPU ranks: rank 0's own and the others' opened over CUDA IPC,
        workers/kv/cuda_ipc.py)."""
        size = len(caches)
        return cls(tuple(caches), tuple(TensorParallel(size, r).kv_heads(cfg) for r in range(size)), cfg.num_kv_heads)

    def block_shape(self) -> tuple[int, int, int, int]:
        """(num_blocks, block_size, KV heads of the full model, head_dim)."""
        nb, bs, _, hd = self.ranks[0][0][0].shape
        return nb, bs, self.num_kv_heads, hd

    def _owners(self) -> list[int]:
        """One rank per distinct head range (replicated heads: the first rank holding them)."""
        seen: dict[tuple[int, int], int] = {}
        for r, h in enumerate(self.heads):
            seen.setdefault(h, r)
        return list(seen.values())

    def gather_into(self, layer: int, block_ids: Sequence[int], k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """K and V of `block_ids` of `layer`, full heads, into `k_out`/`v_out` ([n, bs, heads, hd])."""
        idx = _index(block_ids)
        own = self.ranks[0][0][0].device
        if own.type == "cuda" and any(self.ranks[r][0][0].device != own for r in self._owners()):
            # Another GPU's blocks: their writes (the follower's step) are ordered before rank 0's
            # step's end, which this thread's stream has waited for (the handoff's `written`
            # event), but no stream of this process on that GPU has: wait on the host here.
            torch.cuda.current_stream(own).synchronize()
        for r in self._owners():
            first, n = self.heads[r]
            for cache, out in zip(self.ranks[r][layer], (k_out, v_out), strict=True):
                part = cache[idx] if isinstance(idx, slice) else cache.index_select(0, idx.to(cache.device))
                out[:, :, first : first + n].copy_(part)  # from another GPU: a device-to-device copy

    def scatter_from(self, layer: int, block_ids: Sequence[int], k: np.ndarray, v: np.ndarray) -> None:
        """Write full-head K and V bytes (uint8 [n, bs, heads, hd * itemsize]: a received frame, read
        only) into `block_ids` of `layer` on every rank (numpy for host caches: it copies from a
        read-only buffer). Copies to the other ranks' GPUs are waited for here: those ranks are
        processes of their own, which no stream event of this one orders."""
        idx = _index(block_ids)
        rows = idx if isinstance(idx, slice) else idx.numpy()
        devices: set[torch.device] = set()
        for r, (first, n) in enumerate(self.heads):
            for cache, src in zip(self.ranks[r][layer], (k, v), strict=True):
                part = src[:, :, first : first + n]
                if cache.device.type == "cpu":
                    cache.view(torch.uint8).numpy()[rows] = part
                    continue
                dst = cache.view(torch.uint8)
                t = torch.from_numpy(np.require(part, requirements=["C", "W"])).to(cache.device)
                if isinstance(idx, slice):
                    dst[idx].copy_(t)
                else:
                    dst.index_copy_(0, idx.to(cache.device), t)
                devices.add(cache.device)
        # Rank 0's own copies are ordered like a one-rank engine's (the caller's stream events).
        for device in devices - {self.ranks[0][0][0].device}:
            torch.cuda.synchronize(device)


def _index(block_ids: Sequence[int]) -> slice | torch.Tensor:
    ids = list(block_ids)
    if ids and ids[-1] - ids[0] == len(ids) - 1 and all(b == ids[0] + i for i, b in enumerate(ids)):
        return slice(ids[0], ids[0] + len(ids))  # blocks in a row: one strided copy a rank
    return torch.tensor(ids, dtype=torch.long)
