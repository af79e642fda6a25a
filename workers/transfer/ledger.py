"""Bookkeeping of transfers on each side, shared by every backend.

`ReceiverLedger` is the receiver's whole decision procedure: which messages
are written into the cache, when a transfer is DONE or FAILED, and that
nothing is written once it is terminal. `LedgerReceiver` answers the
KVReceiver calls from it, for every backend. `SenderBook` is the sender's
view: transfer ids, sequence numbers, and what the receiver last reported.
Backends only move bytes; they call these and deliver what they return
(acks, and aborts for the other side).
"""

from __future__ import annotations

import abc
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.workers.messages import (
    ChecksumKind,
    FailReason,
    KVTransferAbort,
    KVTransferAck,
    KVTransferHeader,
    TransferState,
)
from pdserve.workers.transfer import frames, streams
from pdserve.workers.transfer.base import DONE, PENDING, KVReceiver, TransferError, TransferStatus
from pdserve.workers.transfer.frames import CacheGeometry, KVCaches

log = logging.getLogger(__name__)

# How long a transfer's end waits for its writes still queued on a copy stream (device copies of one message
# each, over in microseconds): past it the device is wedged, and the transfer fails rather than hang.
WRITES_WAIT_S = 10.0


@dataclass(frozen=True)
class Notice:
    """A message the backend must deliver to `peer` (its own handle for the other side)."""

    peer: Any
    message: KVTransferAbort


@dataclass
class _Registration:
    dst_block_ids: tuple[int, ...]
    expected_layers: int
    status: TransferStatus = PENDING
    transfer_id: int | None = None  # bound to the first sender attempt seen
    peer: Any = None
    seqs: set[int] = field(default_factory=set)
    end_seq: int | None = None  # from the end marker: how many data messages there were
    covered: list[set[int]] = field(default_factory=list)  # per expected layer: blocks written
    writes: list[Any] = field(default_factory=list)  # events after writes queued on a copy stream (`streams`)
    # After the engine's work queued when the blocks were reserved (CUDA): a step in flight may
    # still write a slot of a request it dropped into these blocks (async scheduling); the writes
    # here wait for it on the device.
    blocks_free: Any = None

    def progress(self) -> str:
        full = sum(len(c) == len(self.dst_block_ids) for c in self.covered)
        end = "seen" if self.end_seq is not None else "not seen"
        return f"{full}/{self.expected_layers} layers complete, {len(self.seqs)} messages, end marker {end}"


class ReceiverLedger:
    """Registered transfers of one receiver, and the only code that writes received KV into its cache.

    Thread-safe. Writes happen under the lock, after the checksum passed and only
    while the transfer is PENDING, so when `abort`/`release` return, or a terminal
    status is observed, no write is in flight and none will follow. A write that a
    backend queues on a copy stream of its own (NCCL: device staging into the cache)
    is not waited for message by message: its event is, on the host, before the
    transfer becomes terminal (`streams`; at most `writes_wait_s`, then FAILED(INTERNAL)).
    """

    def __init__(self, kv_caches: KVCaches, writes_wait_s: float = WRITES_WAIT_S) -> None:
        self.kv_caches = kv_caches
        self.geometry = CacheGeometry.of(kv_caches)
        self.writes_wait_s = writes_wait_s
        self._cond = threading.Condition()
        self._regs: dict[str, _Registration] = {}
        self._closed = False

    @property
    def num_registered(self) -> int:
        with self._cond:
            return len(self._regs)

    def register(self, request_id: str, dst_block_ids: Sequence[int], expected_layers: int) -> None:
        ids = tuple(dst_block_ids)
        if not ids:
            raise ValueError("dst_block_ids: empty")
        self.geometry.check_blocks("dst_block_ids", ids)
        if not (type(expected_layers) is int and 1 <= expected_layers <= self.geometry.num_layers):
            raise ValueError(f"expected_layers: {expected_layers!r} is outside [1, {self.geometry.num_layers}]")
        with self._cond:
            if self._closed:
                raise TransferError(request_id, FailReason.CLOSED, "receiver is closed")
            if request_id in self._regs:
                raise ValueError(f"request {request_id!r} is already registered")
            covered: list[set[int]] = [set() for _ in range(expected_layers)]
            # Engine thread: after the steps queued on its stream so far.
            blocks_free = streams.record(self.geometry.device)
            self._regs[request_id] = _Registration(ids, expected_layers, covered=covered, blocks_free=blocks_free)

    def status(self, request_id: str) -> TransferStatus:
        with self._cond:
            return self._get(request_id).status

    def wait(self, request_id: str, deadline: float) -> tuple[TransferStatus, Notice | None]:
        """The terminal status, or FAILED(TIMEOUT) at `deadline` plus an abort for the sender."""
        with self._cond:
            reg = self._get(request_id)
            while not reg.status.terminal:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    detail = f"not complete at the deadline: {reg.progress()}"
                    self._fail(reg, FailReason.TIMEOUT, detail)
                    return reg.status, self._notice(request_id, reg, f"receiver timed out: {detail}")
                self._cond.wait(remaining)
            return reg.status, None

    def abort(self, request_id: str, reason: str) -> Notice | None:
        """Forget the request; an abort for the sender if it was still pending and a sender is known."""
        with self._cond:
            reg = self._regs.pop(request_id, None)
            if reg is None or reg.status.terminal:
                return None
            self._fail(reg, FailReason.ABORTED, f"aborted by the receiver: {reason}")
            return self._notice(request_id, reg, reason)

    def close(self) -> list[Notice]:
        """Fail every pending transfer with CLOSED; refuse new registrations."""
        with self._cond:
            self._closed = True
            notices = []
            for request_id, reg in self._regs.items():
                if not reg.status.terminal:
                    self._fail(reg, FailReason.CLOSED, "receiver closed")
                    if (n := self._notice(request_id, reg, "receiver closed")) is not None:
                        notices.append(n)
            return notices

    def on_abort(self, msg: KVTransferAbort, peer: Any) -> None:
        """The sender aborted: fail the transfer it owns (never another attempt's)."""
        with self._cond:
            reg = self._regs.get(msg.request_id)
            if reg is None or reg.status.terminal:
                return
            if reg.transfer_id is not None and msg.transfer_id != reg.transfer_id:
                return
            self._fail(reg, FailReason.ABORTED, f"aborted by the sender: {msg.reason}")

    def apply(self, header: KVTransferHeader, k_frame: Any, v_frame: Any, peer: Any, *,
              verify: bool = True) -> KVTransferAck:
        """Verify one message and, if it is good and its transfer pending, write it. Always returns an ack.

        The frames are buffers in host memory, or flat uint8 tensors on any device (`frames.scatter`).
        `verify=False` skips the checksum (the two ends negotiated none at hello); every other check stays.
        """
        data = not header.is_last
        # Outside the lock: the checksum is the slow part and depends only on the bytes.
        crc, unverifiable = None, None
        if data and verify:
            try:
                crc = frames.checksum(header.checksum_kind, k_frame, v_frame)
            except ValueError as e:  # a kind we did not offer to compute
                unverifiable = str(e)
        with self._cond:
            reg = self._regs.get(header.request_id)
            if reg is None:
                return _ack(header, TransferStatus(TransferState.FAILED, FailReason.UNKNOWN_REQUEST,
                                                   "not registered on the receiver (never, or released)"))
            if reg.transfer_id is None:
                reg.transfer_id, reg.peer = header.transfer_id, peer
            elif header.transfer_id != reg.transfer_id:
                # A stale or second sender must not disturb the attempt that owns the blocks.
                return _ack(header, TransferStatus(TransferState.FAILED, FailReason.PROTOCOL,
                                                   f"registration is bound to transfer {reg.transfer_id}"))
            if reg.status.terminal:
                return _ack(header, reg.status)  # discarded: the blocks may be someone else's now
            problem = unverifiable or self._problem(reg, header, k_frame, v_frame)
            if problem is not None:
                self._fail(reg, FailReason.PROTOCOL, problem)
            elif data and verify and crc != header.checksum:
                self._fail(reg, FailReason.CHECKSUM, f"layer {header.layer} seq {header.seq}: "
                           f"{header.checksum_kind.value} {crc:#x} != header's {header.checksum:#x}")
            elif data:
                try:
                    streams.wait_for(reg.blocks_free, self.geometry.device)
                    frames.scatter(self.kv_caches, self.geometry, header.layer, header.dst_block_ids, k_frame, v_frame)
                except Exception as e:  # e.g. a device error mid-copy: the blocks hold a mix; the transfer is over
                    log.exception("KV receiver: writing %r layer %d failed", header.request_id, header.layer)
                    self._queued(reg)
                    self._fail(reg, FailReason.INTERNAL, f"writing into the cache failed: {e!r}")
                else:
                    self._queued(reg)
                    reg.seqs.add(header.seq)
                    reg.covered[header.layer].update(header.dst_block_ids)
                    self._settle(reg)
            else:
                reg.end_seq = header.seq
                self._settle(reg)
            return _ack(header, reg.status)

    def fail_transfer(self, header: KVTransferHeader, reason: FailReason, detail: str) -> KVTransferAck:
        """The bytes of `header`'s message never arrived (a broken data channel): fail its transfer, if the
        registration is pending and not bound to another attempt; the refusal to send back."""
        with self._cond:
            reg = self._regs.get(header.request_id)
            if reg is not None and not reg.status.terminal and reg.transfer_id in (None, header.transfer_id):
                self._fail(reg, reason, detail)
        return refusal(header, reason, detail)

    # -- helpers (lock held) ---------------------------------------------------------

    def _get(self, request_id: str) -> _Registration:
        reg = self._regs.get(request_id)
        if reg is None:
            raise KeyError(f"request {request_id!r} is not registered")
        return reg

    def _problem(self, reg: _Registration, header: KVTransferHeader, k_frame: Any, v_frame: Any) -> str | None:
        if header.seq in reg.seqs or header.seq == reg.end_seq:
            return f"seq {header.seq} seen twice"
        if header.is_last:
            if reg.end_seq is not None:
                return "two end markers"
            if reg.seqs and max(reg.seqs) >= header.seq:
                return f"end marker says {header.seq} messages but seq {max(reg.seqs)} arrived"
            return None
        if reg.end_seq is not None and header.seq >= reg.end_seq:
            return f"seq {header.seq} after an end marker that said {reg.end_seq} messages"
        if header.layer >= reg.expected_layers:
            return f"layer {header.layer} not expected (registered {reg.expected_layers} layers)"
        if not set(header.dst_block_ids) <= set(reg.dst_block_ids):
            stray = sorted(set(header.dst_block_ids) - set(reg.dst_block_ids))
            return f"blocks {stray[:8]} are not registered for this request"
        return frames.header_problem(header, self.geometry, _nbytes(k_frame), _nbytes(v_frame))

    def _settle(self, reg: _Registration) -> None:
        if reg.end_seq is None or len(reg.seqs) < reg.end_seq:
            return  # messages still on the way (or lost: wait() will time out)
        missing = [layer for layer, c in enumerate(reg.covered) if len(c) != len(reg.dst_block_ids)]
        if missing:
            self._fail(reg, FailReason.PROTOCOL, f"sender finished without every block of layers {missing[:8]}")
        elif not self._writes_over(reg):
            self._fail(reg, FailReason.INTERNAL, f"writes into the cache not over after {self.writes_wait_s} s")
        else:
            reg.status = DONE
            self._cond.notify_all()

    def _fail(self, reg: _Registration, reason: FailReason, detail: str) -> None:
        if not self._writes_over(reg):  # the device is wedged: nothing better to do than say so
            log.error("KV receiver: writes of a transfer that fails (%s) still queued after %.1f s; its blocks may "
                      "yet change", reason.value, self.writes_wait_s)
        reg.status = TransferStatus(TransferState.FAILED, reason, detail)
        self._cond.notify_all()

    def _queued(self, reg: _Registration) -> None:
        """After a write: its event if the backend queued it on a copy stream (none on the CPU)."""
        event = streams.record(self.geometry.device, side_only=True)
        if event is not None:
            reg.writes = [e for e in reg.writes if not e.query()]  # over already: nothing to wait for
            reg.writes.append(event)

    def _writes_over(self, reg: _Registration) -> bool:
        """Wait (host) until the writes queued for `reg` are over, `writes_wait_s` at most; False if not."""
        deadline = time.monotonic() + self.writes_wait_s
        over = all([streams.wait_done(e, deadline) for e in reg.writes])
        if over:
            reg.writes.clear()
        return over

    @staticmethod
    def _notice(request_id: str, reg: _Registration, reason: str) -> Notice | None:
        if reg.peer is None:
            return None  # nothing arrived yet; the sender learns from its first ack
        return Notice(reg.peer, KVTransferAbort(request_id=request_id, transfer_id=reg.transfer_id or 0, reason=reason))


def _ack(header: KVTransferHeader, status: TransferStatus) -> KVTransferAck:
    return KVTransferAck(request_id=header.request_id, transfer_id=header.transfer_id, seq=header.seq,
                         state=status.state, reason=status.reason, detail=status.detail)


def refusal(header: KVTransferHeader, reason: FailReason, detail: str, credits: int = 1) -> KVTransferAck:
    """An ack that refuses `header`'s message without the ledger (`credits=0`: it had no credit to return)."""
    return KVTransferAck(request_id=header.request_id, transfer_id=header.transfer_id, seq=header.seq,
                         state=TransferState.FAILED, reason=reason, detail=detail, credits=credits)


def _nbytes(frame: Any) -> int:
    if isinstance(frame, torch.Tensor):
        return frame.numel() * frame.element_size()
    return memoryview(frame).nbytes


class LedgerReceiver(KVReceiver):
    """The KVReceiver calls every backend answers the same way, from its `ReceiverLedger`.

    A backend adds how aborts reach its senders (`_post`) and what else it stops on close (`_close_backend`).
    """

    def __init__(self, ledger: ReceiverLedger) -> None:
        self._ledger = ledger
        self._closed = False

    def register(self, request_id: str, dst_block_ids: Sequence[int], expected_layers: int) -> None:
        self._ledger.register(request_id, dst_block_ids, expected_layers)

    @property
    def num_registered(self) -> int:
        """Requests whose KV this receiver awaits (registered, not yet released)."""
        return self._ledger.num_registered

    def poll(self, request_id: str) -> TransferStatus:
        return self._ledger.status(request_id)

    def wait(self, request_id: str, deadline: float) -> TransferStatus:
        status, notice = self._ledger.wait(request_id, deadline)
        self._post(notice)
        return status

    def abort(self, request_id: str, reason: str = "aborted by the decode worker") -> None:
        self._post(self._ledger.abort(request_id, reason))

    def release(self, request_id: str) -> None:
        self._post(self._ledger.abort(request_id, "released by the decode worker"))

    def close(self) -> None:
        """Fail every pending transfer with CLOSED (telling its sender), then stop the backend. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for notice in self._ledger.close():
            self._post(notice)
        self._close_backend()

    def _close_backend(self) -> None:
        """Stop what the backend runs (threads, sockets), after the ledger closed. Nothing by default."""

    @abc.abstractmethod
    def _post(self, notice: Notice | None) -> None:
        """Deliver `notice` (an abort) to its sender; None: nothing to deliver.

        Called from API threads, with no ledger lock held; must not block on the peer.
        """


@dataclass
class _Outgoing:
    transfer_id: int
    next_seq: int = 0
    status: TransferStatus = PENDING  # as the receiver last reported it


class SenderBook:
    """A sender's transfers in flight: ids, sequence numbers, the receiver's reports. Not locked."""

    def __init__(self, kv_caches: KVCaches) -> None:
        self.kv_caches = kv_caches
        self.geometry = CacheGeometry.of(kv_caches)
        self._out: dict[str, _Outgoing] = {}

    def check_send(self, request_id: str, layer: int, src_block_ids: Sequence[int],
                   dst_block_ids: Sequence[int]) -> None:
        """ValueError for bad arguments; TransferError if the receiver already failed the transfer."""
        self.geometry.check_layer(layer)
        if not src_block_ids or len(src_block_ids) != len(dst_block_ids):
            raise ValueError(f"src/dst block ids: need the same non-zero count, got {len(src_block_ids)} "
                             f"and {len(dst_block_ids)}")
        self.geometry.check_blocks("src_block_ids", src_block_ids)
        if any(type(b) is not int or b < 0 for b in dst_block_ids) or len(set(dst_block_ids)) != len(dst_block_ids):
            raise ValueError("dst_block_ids: must be distinct ints >= 0")
        self.raise_if_failed(request_id)

    def raise_if_failed(self, request_id: str) -> None:
        out = self._out.get(request_id)
        if out is not None and out.status.state is TransferState.FAILED:
            del self._out[request_id]
            assert out.status.reason is not None
            raise TransferError(request_id, out.status.reason, out.status.detail)

    def data_header(self, request_id: str, layer: int, dst_block_ids: Sequence[int], kind: ChecksumKind,
                    checksum: int) -> KVTransferHeader:
        """The header of the request's next data message (the seq is taken only by `commit`)."""
        out = self._out.setdefault(request_id, _Outgoing(_new_transfer_id()))
        g = self.geometry
        return KVTransferHeader(request_id=request_id, transfer_id=out.transfer_id, seq=out.next_seq, layer=layer,
                                dst_block_ids=tuple(dst_block_ids), num_blocks=len(dst_block_ids),
                                dtype=g.dtype_name, block_shape=g.block_shape, checksum_kind=kind, checksum=checksum)

    def end_header(self, request_id: str) -> KVTransferHeader:
        out = self._out.get(request_id)
        if out is None:
            raise ValueError(f"finish: nothing was sent for request {request_id!r}")
        return KVTransferHeader(request_id=request_id, transfer_id=out.transfer_id, seq=out.next_seq, layer=0,
                                dst_block_ids=(), num_blocks=0, dtype=self.geometry.dtype_name,
                                block_shape=self.geometry.block_shape, checksum_kind=ChecksumKind.CRC32,
                                checksum=0, is_last=True)

    def commit(self, header: KVTransferHeader) -> None:
        self._out[header.request_id].next_seq = header.seq + 1

    def status(self, request_id: str) -> TransferStatus | None:
        out = self._out.get(request_id)
        return None if out is None else out.status

    def settled(self, request_id: str) -> bool:
        """Whether the receiver reported DONE or FAILED; TransferError if the request was aborted meanwhile."""
        out = self._out.get(request_id)
        if out is None:
            raise TransferError(request_id, FailReason.ABORTED, "aborted by the sender while finishing")
        return out.status.terminal

    def transfer_id(self, request_id: str) -> int:
        out = self._out.get(request_id)
        return 0 if out is None else out.transfer_id

    def on_ack(self, ack: KVTransferAck) -> None:
        out = self._out.get(ack.request_id)
        if out is None or out.transfer_id != ack.transfer_id or out.status.terminal:
            return  # a late ack of a transfer we finished or aborted
        if ack.state is not TransferState.PENDING:
            out.status = TransferStatus(ack.state, ack.reason, ack.detail)

    def on_abort(self, msg: KVTransferAbort) -> None:
        out = self._out.get(msg.request_id)
        if out is not None and out.transfer_id == msg.transfer_id and not out.status.terminal:
            detail = f"aborted by the receiver: {msg.reason}"
            out.status = TransferStatus(TransferState.FAILED, FailReason.ABORTED, detail)

    def fail_pending(self, reason: FailReason, detail: str) -> list[tuple[str, int]]:
        """Fail every transfer the receiver has not settled (the link they travelled on is gone), so that each
        raises at its sender's next call; their (request id, transfer id)."""
        failed = []
        for request_id, out in self._out.items():
            if not out.status.terminal:
                out.status = TransferStatus(TransferState.FAILED, reason, detail)
                failed.append((request_id, out.transfer_id))
        return failed

    def request_ids(self) -> list[str]:
        return list(self._out)

    def forget(self, request_id: str) -> None:
        self._out.pop(request_id, None)


def _new_transfer_id() -> int:
    # Random, not a counter: a restarted sender must not reuse the id of its previous life.
    return int.from_bytes(os.urandom(8), "little") >> 1 or 1
