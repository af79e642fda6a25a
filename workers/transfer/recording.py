"""Per-handoff accounting on the sending side, over any `KVSender`.

`RecordingSender` wraps a backend's sender and tells a `TransferRecorder` (the
worker's metrics) what each request's handoff cost: the K/V bytes it moved and
the time from its first `send` to `finish` returning (for a prompt prefilled in
one chunk that is the transfer alone; with chunked prefill the later chunks'
compute overlaps it), and the reason of every `TransferError` the transport
raised. Bytes are the blocks' bytes in the cache layout, which is exactly what
every backend puts on the wire (frames are the gathered blocks, no repacking).

The transport stays free of any metrics library: the recorder is a protocol.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.workers.transfer.base import KVSender, TransferError
from pdserve.workers.transfer.frames import CacheGeometry, KVCaches


class TransferRecorder(Protocol):
    """Receives transfer outcomes; called on the thread that drives the sender
    (the prefill worker's engine thread) or the receiver: keep it cheap."""

    def on_handoff(self, nbytes: int, duration_s: float) -> None:
        """One request's KV reached the receiver and was verified."""

    def on_failure(self, kind: str) -> None:
        """A transfer failed; `kind` is a `FailReason` value (timeout, checksum, aborted, ...)."""


@dataclass
class _Handoff:
    started: float
    nbytes: int = 0


class RecordingSender(KVSender):
    """A `KVSender` that forwards every call to `inner` and records its outcome."""

    def __init__(self, inner: KVSender, kv_caches: KVCaches, recorder: TransferRecorder) -> None:
        self.inner = inner
        self.recorder = recorder
        # K + V bytes of one block, per layer (every layer alike: CacheGeometry checks it).
        geometry = CacheGeometry.of(kv_caches)
        self._block_bytes = [2 * geometry.block_bytes] * geometry.num_layers
        self._lock = threading.Lock()
        self._open: dict[str, _Handoff] = {}

    def send(self, request_id: str, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             deadline: float) -> None:
        with self._lock:
            handoff = self._open.setdefault(request_id, _Handoff(time.perf_counter()))
        try:
            self.inner.send(request_id, layer, src_block_ids, dst_block_ids, deadline)
        except TransferError as e:
            self._failed(request_id, e)
            raise
        handoff.nbytes += len(src_block_ids) * self._block_bytes[layer]

    def finish(self, request_id: str, deadline: float) -> None:
        try:
            self.inner.finish(request_id, deadline)
        except TransferError as e:
            self._failed(request_id, e)
            raise
        with self._lock:
            handoff = self._open.pop(request_id, None)
        if handoff is not None:  # None: nothing was sent (the receiver cached every block)
            self.recorder.on_handoff(handoff.nbytes, time.perf_counter() - handoff.started)

    def abort(self, request_id: str, reason: str) -> None:
        # The caller's decision (client gone, its own deadline): the caller counts it if it is a failure.
        with self._lock:
            self._open.pop(request_id, None)
        self.inner.abort(request_id, reason)

    def close(self) -> None:
        with self._lock:
            self._open.clear()
        self.inner.close()

    def link_down_s(self) -> float:
        return self.inner.link_down_s()

    def _failed(self, request_id: str, e: TransferError) -> None:
        with self._lock:
            self._open.pop(request_id, None)
        self.recorder.on_failure(e.reason.value)


__all__ = ["RecordingSender", "TransferRecorder"]
