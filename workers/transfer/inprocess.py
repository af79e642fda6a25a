"""In-process KV transport: sender and receiver share a process, for unit tests.

It runs the real protocol minus the socket: messages are encoded and decoded,
frames are the gathered bytes with their checksum, the receiver's ledger
decides what is written. So a test of a failure path here (drop, corrupt,
delay, through the test seam: workers/fault_seam.py) tests the same
decisions the ZeroMQ backend makes.
Delivery is synchronous (no credits needed: nothing is buffered), except for
delayed messages, which a timer thread delivers later.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from pdserve.workers.fault_seam import FaultAction, TransferFaults, corrupted
from pdserve.workers.messages import (
    ChecksumKind,
    FailReason,
    KVTransferAbort,
    KVTransferAck,
    KVTransferHeader,
    decode,
    decode_as,
    encode,
)
from pdserve.workers.transfer import frames
from pdserve.workers.transfer.base import KVSender, TransferError
from pdserve.workers.transfer.frames import KVCaches
from pdserve.workers.transfer.ledger import LedgerReceiver, Notice, ReceiverLedger, SenderBook

_EMPTY = np.zeros(0, dtype=np.uint8)
_TIMER_JOIN_S = 1.0


class InProcessReceiver(LedgerReceiver):
    """Writes into `kv_caches` what an `InProcessSender` bound to it delivers."""

    address = "inproc"  # senders are bound to it directly: the address only names it

    def __init__(self, kv_caches: KVCaches) -> None:
        super().__init__(ReceiverLedger(kv_caches))

    def _post(self, notice: Notice | None) -> None:
        if notice is not None:
            sender: InProcessSender = notice.peer
            sender.on_message(encode(notice.message))

    # -- called by the sender ----------------------------------------------------------

    def deliver(self, header: bytes, k_frame: np.ndarray, v_frame: np.ndarray, sender: InProcessSender) -> bytes:
        """One data message or end marker in; its encoded ack out."""
        ack = self._ledger.apply(decode_as(header, KVTransferHeader), k_frame, v_frame, peer=sender)
        return encode(ack)

    def deliver_abort(self, message: bytes, sender: InProcessSender) -> None:
        self._ledger.on_abort(decode_as(message, KVTransferAbort), peer=sender)


class InProcessSender(KVSender):
    """Copies blocks of `kv_caches` into an `InProcessReceiver`'s cache through the real message path."""

    def __init__(self, kv_caches: KVCaches, receiver: InProcessReceiver, faults: TransferFaults | None = None,
                 checksum: ChecksumKind = frames.CHECKSUMS[0]) -> None:
        self._book = SenderBook(kv_caches)
        self._checksum = checksum
        self._receiver = receiver
        self._faults = faults
        self._cond = threading.Condition()
        self._timers: list[threading.Timer] = []
        self._closed = False

    def send(self, request_id: str, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             deadline: float) -> None:
        src, dst = list(src_block_ids), list(dst_block_ids)
        with self._cond:
            self._check_open(request_id)
            self._book.check_send(request_id, layer, src, dst)
            k_frame, v_frame = frames.gather(self._book.kv_caches, layer, src)
            crc = frames.checksum(self._checksum, k_frame, v_frame)
            header = self._book.data_header(request_id, layer, dst, self._checksum, crc)
            self._book.commit(header)
        self._transmit(header, k_frame, v_frame)

    def finish(self, request_id: str, deadline: float) -> None:
        with self._cond:
            self._check_open(request_id)
            self._book.raise_if_failed(request_id)
            header = self._book.end_header(request_id)
            self._book.commit(header)
        self._transmit(header, _EMPTY, _EMPTY)
        with self._cond:
            try:
                while not self._book.settled(request_id):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self._abort_locked(request_id, "sender timed out waiting for the receiver to finish")
                        raise TransferError(request_id, FailReason.TIMEOUT, "no DONE from the receiver by the deadline")
                    self._cond.wait(remaining)
                self._book.raise_if_failed(request_id)
            finally:
                self._book.forget(request_id)

    def abort(self, request_id: str, reason: str) -> None:
        with self._cond:
            self._abort_locked(request_id, reason)

    def close(self) -> None:
        with self._cond:
            for request_id in self._book.request_ids():  # unfinished: the receiver must not wait for them
                self._abort_locked(request_id, "sender closed")
            self._closed = True
            timers, self._timers = self._timers, []
        for t in timers:
            t.cancel()
            t.join(_TIMER_JOIN_S)

    # -- called by the receiver (acks, and its aborts) ---------------------------------

    def on_message(self, data: bytes) -> None:
        msg = decode(data)
        with self._cond:
            if isinstance(msg, KVTransferAck):
                self._book.on_ack(msg)
            elif isinstance(msg, KVTransferAbort):
                self._book.on_abort(msg)
            self._cond.notify_all()

    # -- helpers -------------------------------------------------------------------------

    def _transmit(self, header: KVTransferHeader, k_frame: np.ndarray, v_frame: np.ndarray) -> None:
        fault = self._faults.on_send(header) if self._faults is not None else None  # the test seam
        if fault is not None and fault.action is FaultAction.DROP:
            return
        if fault is not None and fault.action is FaultAction.CORRUPT:
            k_frame = corrupted(k_frame)
        wire = encode(header)
        if fault is not None and fault.action is FaultAction.DELAY:
            timer = threading.Timer(fault.delay_s, self._deliver, (wire, k_frame, v_frame))
            timer.daemon = True
            with self._cond:
                self._timers.append(timer)
            timer.start()
            return
        self._deliver(wire, k_frame, v_frame)

    def _deliver(self, wire: bytes, k_frame: np.ndarray, v_frame: np.ndarray) -> None:
        self.on_message(self._receiver.deliver(wire, k_frame, v_frame, sender=self))

    def _abort_locked(self, request_id: str, reason: str) -> None:
        if self._book.status(request_id) is None:
            return
        msg = KVTransferAbort(request_id=request_id, transfer_id=self._book.transfer_id(request_id), reason=reason)
        self._book.forget(request_id)
        self._receiver.deliver_abort(encode(msg), sender=self)

    def _check_open(self, request_id: str) -> None:
        if self._closed:
            raise TransferError(request_id, FailReason.CLOSED, "sender is closed")


__all__ = ["InProcessReceiver", "InProcessSender"]
