"""The data channel of the NCCL/gloo KV transport (see `nccl_backend`): one pair's two-rank process
group, its staging buffers, and the flat K-then-V tensor a message travels as.
"""

from __future__ import annotations

import datetime
import logging
import math
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pdserve.workers.kv.shared_cache import ShardedKV
from pdserve.workers.messages import KVTransferHeader
from pdserve.workers.transfer import frames
from pdserve.workers.transfer.frames import CacheGeometry, KVCaches

log = logging.getLogger(__name__)

TAG_MAX = (1 << 31) - 1  # gloo tags are int32; 0 is the probe's
_NCCL_POLL_S = 0.0002


def pick_backend(geometry: CacheGeometry, backend: str | None) -> str:
    """'nccl' for CUDA caches, 'gloo' for CPU ones, unless `backend` forces one; ValueError if it cannot be."""
    if backend is None:
        backend = "nccl" if geometry.device.type == "cuda" else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend: expected 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and geometry.device.type != "cuda":
        raise ValueError(f"backend 'nccl' needs CUDA caches, these are on {geometry.device}")
    available = dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()
    if not (dist.is_available() and available):
        raise RuntimeError(f"this torch build has no {backend} backend")
    return backend


def staging_device(geometry: CacheGeometry, backend: str) -> torch.device:
    """NCCL moves device memory; gloo moves host memory (CUDA caches are staged through the host)."""
    return geometry.device if backend == "nccl" else torch.device("cpu")


def first_line(e: BaseException) -> str:
    """An exception in one short line, for logs and a transfer's failure detail."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


class DataChannel:
    """This process's rank of one pair's two-rank process group (receiver rank 0, sender rank 1).

    The constructor is the rendezvous: it blocks until the other rank joins and the probe passed, at
    most `timeout_s`, and raises if that fails.
    """

    def __init__(self, backend: str, store: Any, key: str, rank: int, timeout_s: float,
                 device: torch.device, gloo_hostname: str | None) -> None:
        self.backend, self.rank, self.device, self.timeout_s = backend, rank, device, timeout_s
        self._store = store  # a Python Store must outlive the group: c10d calls back into this object
        prefixed = dist.PrefixStore(f"pdserve-kv/{key}", store)  # type: ignore[attr-defined]
        timeout = datetime.timedelta(seconds=timeout_s)
        self._pg: Any
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # c10d's private options
            gloo = dist.ProcessGroupGloo
            opts._devices = [gloo.create_device(hostname=gloo_hostname) if gloo_hostname
                             else gloo.create_default_device()]
            opts._timeout = timeout
            self._pg = gloo(prefixed, rank, 2, opts)
        else:
            nccl_opts: Any = dist.ProcessGroupNCCL.Options()
            nccl_opts.is_high_priority_stream = False
            nccl_opts._timeout = timeout
            nccl_opts.group_name = f"pdserve-kv-{key}"
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, 2, nccl_opts)
        self._closed = False
        probe = torch.zeros(1, dtype=torch.uint8, device=device)
        work = self.send(probe, 0) if rank == 1 else self.recv(probe, 0)
        self.wait(work, time.monotonic() + timeout_s)

    def send(self, tensor: torch.Tensor, tag: int) -> Any:
        return self._group().send([tensor], 1 - self.rank, tag)

    def recv(self, tensor: torch.Tensor, tag: int) -> Any:
        return self._group().recv([tensor], 1 - self.rank, tag)

    def _group(self) -> Any:
        if self._pg is None:
            raise RuntimeError("the data channel is closed")
        return self._pg

    def wait(self, work: Any, deadline: float, stop: threading.Event | None = None) -> None:
        """Until `work` completed; raises if it failed or (NCCL) at `deadline` or `stop`, aborting the group."""
        if self.backend == "gloo":
            work.wait()  # cannot be interrupted; bounded by the group's timeout (see the module docstring)
            return
        while not work.is_completed():
            if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                self.close()
                raise TimeoutError("NCCL operation not complete in time; the pair's communicator was aborted")
            time.sleep(_NCCL_POLL_S)
        work.wait()  # raises a failure; orders the current stream after the operation

    def close(self) -> None:
        """Shut this rank down. Its connection closes once the group and every Work of it are unreferenced
        (the caller drops its Works): only then does the peer's pending operation fail instead of waiting
        out the timeout, since gloo keeps serving posted sends after `shutdown()` and forgets those whose
        Work is dropped."""
        if self._closed:
            return
        self._closed = True
        pg, self._pg = self._pg, None
        try:
            if self.backend == "nccl":
                pg.abort()  # the only way to end a pending NCCL operation
            else:
                pg.shutdown()
        except Exception as e:  # already broken: nothing left to release
            log.debug("KV data channel (rank %d): close: %s", self.rank, first_line(e))


class Staging:
    """Reused flat uint8 buffers on one device (a fresh 16 MB buffer per message costs page faults).

    A sender holds a message's buffer, with the Work of its send, until the receiver acks the message:
    the receiver then has every byte, so the send is over and the buffer may be overwritten.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: list[torch.Tensor] = []
        self._held: dict[tuple[str, int, int], tuple[torch.Tensor, Any]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        buf = self._free.pop() if self._free else None
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)  # grows to the largest message
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self._free.append(buf)

    def hold(self, key: tuple[str, int, int], buf: torch.Tensor, work: Any) -> None:
        self._held[key] = (buf, work)

    def release(self, key: tuple[str, int, int]) -> None:
        held = self._held.pop(key, None)
        if held is None:
            return
        buf, work = held
        try:
            work.wait()  # complete: the receiver acked the bytes (NCCL: orders reuse after the send)
        except Exception as e:  # the channel broke after the bytes arrived; the buffer is not reused
            log.debug("KV sender: send of %r ended with %s", key, first_line(e))
            return
        self._free.append(buf)

    def forget(self, key: tuple[str, int, int]) -> None:
        """Drop a held buffer without waiting for its send (the channel is shut: it will not complete)."""
        self._held.pop(key, None)

    def clear(self) -> None:
        self._free.clear()
        self._held.clear()


def gather(kv_caches: KVCaches, geometry: CacheGeometry, layer: int, block_ids: list[int],
           staging: torch.Tensor) -> torch.Tensor:
    """K then V of `block_ids` of `layer`, copied into `staging`; returns the filled prefix.

    One copy per frame, on this thread's current stream: a slice copy for blocks in a row, else
    `index_select(out=)` straight into staging (NCCL: on the device; gloo: into host memory)."""
    n = len(block_ids)
    per = frames.frame_bytes(geometry, n) // 2
    if isinstance(kv_caches, ShardedKV):  # a tensor-parallel engine's ranks: full heads, interleaved
        return frames.gather_sharded(kv_caches, layer, block_ids, staging)
    for i, cache in enumerate(kv_caches[layer]):
        dst = staging[i * per : (i + 1) * per].view(cache.dtype).view(n, *geometry.block_shape)
        frames.select_into(cache, block_ids, dst)
    return staging[: 2 * per]


def host_halves(payload: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The K and V frames of a message as host byte arrays (a device-to-host copy if on a GPU)."""
    host = payload if payload.device.type == "cpu" else payload.cpu()
    half = host.numel() // 2
    return host[:half].numpy(), host[half:].numpy()


def wire_bytes(header: KVTransferHeader) -> int | None:
    """Bytes of the tensor that follows `header`, by its own claims; None if they give no size."""
    dtype = frames.DTYPES.get(header.dtype)
    if dtype is None or header.num_blocks <= 0:
        return None
    return 2 * header.num_blocks * math.prod(header.block_shape) * dtype.itemsize
