"""A GPU rank's KV cache, opened in rank 0's process over CUDA IPC: how a tensor-parallel GPU
worker's KV transfers read and write every rank's heads from rank 0's threads, as CPU ranks do
through their shared host file (workers/kv/shared_cache.py).

A follower rank exports the one allocation under its cache (`allocate_kv_caches` makes one) as
torch.multiprocessing does for a CUDA tensor (`reduce_tensor`: the allocation's IPC handle, its
offsets and the producer's reference counter), encoded with msgpack (never pickle), and sets it
in rank 0's store; rank 0 opens it (`rebuild_cuda_tensor`) on first use. The follower keeps its
cache for its life, so the memory stays valid while rank 0 holds it. Device numbers are the
follower's, which are rank 0's too: the followers inherit rank 0's CUDA_VISIBLE_DEVICES.

Costs: opening another GPU's memory makes a CUDA context on that GPU in rank 0's process (some
hundreds of MiB, after the memory plan: it comes out of 1 - gpu_memory_utilization).

NOT RUN ON A GPU YET: no machine with two GPUs has been lent (docs/tensor-parallel.md).
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

KVCacheList = list[tuple[torch.Tensor, torch.Tensor]]


def ipc_key(rank: int) -> str:
    """Where follower `rank` sets its exported cache in rank 0's store."""
    return f"pdserve/kv-ipc/{rank}"


def whole(kv_caches: KVCacheList) -> torch.Tensor:
    """The one [layers, 2, blocks, block_size, heads, head_dim] tensor under an allocated cache."""
    k0 = kv_caches[0][0]
    full = k0._base
    if (full is None or tuple(full.shape) != (len(kv_caches), 2, *k0.shape) or not full.is_contiguous()
            or full[0, 0].data_ptr() != k0.data_ptr() or full[-1, 1].data_ptr() != kv_caches[-1][1].data_ptr()):
        raise ValueError("KV cache: not one allocation of layers x (K, V) (allocate_kv_caches makes one)")
    return full


def export_cache(kv_caches: KVCacheList) -> bytes:
    """The IPC handle of this rank's cache (a CUDA one), as msgpack bytes."""
    full = whole(kv_caches)
    if full.device.type != "cuda":
        raise ValueError(f"KV cache on {full.device}: only a CUDA cache is shared over CUDA IPC")
    _, args = reduce_tensor(full)  # type: ignore[no-untyped-call]
    (_, size, stride, offset, _, dtype, device, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset,
     event_handle, event_sync) = args
    blob: bytes = msgpack.packb({
        "size": list(size), "stride": list(stride), "offset": offset, "dtype": str(dtype).removeprefix("torch."),
        "device": device, "handle": handle, "storage_bytes": storage_bytes, "storage_offset": storage_offset,
        "ref_handle": ref_handle, "ref_offset": ref_offset, "event_handle": event_handle,
        "event_sync": event_sync})
    return blob


def import_cache(blob: bytes) -> KVCacheList:
    """A follower's exported cache, opened here: per layer (K, V) views of its memory."""
    d: dict[str, Any] = msgpack.unpackb(blob)
    dtype = getattr(torch, d["dtype"])
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"KV cache IPC: {d['dtype']!r} is no torch dtype")
    full: torch.Tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
        torch.Tensor, torch.Size(d["size"]), tuple(d["stride"]), d["offset"], torch.storage.TypedStorage, dtype,
        d["device"], d["handle"], d["storage_bytes"], d["storage_offset"], False, d["ref_handle"], d["ref_offset"],
        d["event_handle"], d["event_sync"])
    return [(full[i, 0], full[i, 1]) for i in range(full.shape[0])]
