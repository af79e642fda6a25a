"""KV transport over ZeroMQ/TCP between any two hosts.

Sockets: the receiver (decode worker) binds one ROUTER; each sender (prefill
worker) connects one DEALER to it. Why ROUTER/DEALER and not PUSH/PULL plus a
back channel:
  * one TCP connection per (prefill, decode) pair carries data one way and
    acks / credits / aborts the other, so there is no second port, no second
    handshake, and no matching of two sockets to one peer;
  * ZeroMQ keeps order per connection: a transfer's end marker arrives after
    all its data, and a credit comes back on the pipe that used it;
  * ROUTER tags each message with its peer, so credits are counted and aborts
    addressed per sender while many prefill workers share one port; PUSH would
    round-robin over peers, which is wrong for addressed data, and its back
    pressure is a silent block at the high-water mark.
ROUTER_MANDATORY makes a reply to a vanished peer an error we log, not a
silent drop.

Messages: a layer's blocks go out in messages of at most `max_message_bytes`
(4 MiB by default), each `[header, K frame, V frame]`: a msgpack
`KVTransferHeader`, then the blocks' raw bytes, sent with copy=False. Source
blocks with consecutive ids (the usual case) are sent straight from the
cache (`frames.cache_frames`: no copy on the sender, which is why `send`
asks the caller to keep its blocks unchanged until `finish`); others are
gathered into a staging buffer that is reused once the message is acked
(fresh multi-MB buffers cost more in page faults than the copy itself). The
receiver takes frames with copy=False, verifies the checksum
(`frames.checksum`: xxh3_64 when both ends have `xxhash`, else CRC-32;
agreed at hello) and only then copies them into its blocks: one copy, into
the cache. `finish` sends `[header]` with `is_last` (the end marker). Why
4 MiB: on loopback 2 MiB messages moved ~10% less per second (per-message
work on both ends), and 8 or 16 MiB no more (bench/kv_transfer.py).

Flow control is credit-based, per sender connection. A new sender says hello
(with the checksums it can compute); the receiver grants `credits` messages
(and names the checksum). Each data message or end marker costs one; the
receiver returns it in the message's ack once the message is written or
rejected. A sender out of credit blocks in `send` until its deadline, then
raises TIMEOUT, so a slow decode worker makes prefill workers wait (visibly),
never buffer without bound: each side holds at most `credits` messages of a
peer, `credits x max_message_bytes` bytes (32 MiB by default). Control
messages (hello, acks, aborts) need no credit.

Threads: the receiver runs one I/O thread that owns its sockets. API calls
(register / poll / wait / abort) work on the shared ledger under its lock and
hand messages for peers (aborts) to the I/O thread through a queue and an
inproc wake-up socket. The sender has no thread: it reads acks and credits
whenever it is called, and its calls are serialized by a lock.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
import uuid
from collections.abc import Sequence

import numpy as np
import zmq

from pdserve.workers.messages import (
    ChecksumKind, FailReason, KVCreditGrant, KVTransferAbort, KVTransferAck, KVTransferHeader, KVTransferHello, Message,
    TransferState, decode, encode,
)
from pdserve.workers.transfer import frames
from pdserve.workers.transfer.base import KVReceiver, KVSender, TransferError, TransferStatus
from pdserve.workers.transfer.faults import FaultAction, Faults, corrupted
from pdserve.workers.transfer.frames import KVCaches
from pdserve.workers.transfer.ledger import Notice, ReceiverLedger, SenderBook

log = logging.getLogger(__name__)

DEFAULT_CREDITS = 8
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
_IDLE_POLL_MS = 50  # the I/O thread's longest sleep: how soon it notices a fault switch
_BATCH = 64  # messages handled per loop turn before the outbox gets a look
_JOIN_S = 2.0
_LINGER_MS = 200  # on close, how long queued aborts may take to leave


class ZmqKVReceiver(KVReceiver):
    """Binds a ROUTER at `bind` (use port `*` for any free one; see `address`) and writes into `kv_caches`."""

    def __init__(self, kv_caches: KVCaches, bind: str = "tcp://127.0.0.1:*", *, credits: int = DEFAULT_CREDITS,
                 context: zmq.Context | None = None, faults: Faults | None = None) -> None:
        if credits < 1:
            raise ValueError(f"credits: must be >= 1, got {credits}")
        self._ledger = ReceiverLedger(kv_caches)
        self._credits = credits
        self._faults = faults
        ctx = context or zmq.Context.instance()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, _LINGER_MS)
        self._sock.bind(bind)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        wake = f"inproc://pdserve-kv-wake-{uuid.uuid4().hex}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.connect(wake)
        self._wake_lock = threading.Lock()  # the one socket API threads touch
        self._outbox: collections.deque[Notice] = collections.deque()
        self._in_flight: dict[bytes, int] = {}  # peer identity -> its messages not yet acked
        # Data read while a test stalls the receiver: at most `credits` messages per well-behaved peer.
        self._parked: collections.deque[tuple[bytes, KVTransferHeader, list[zmq.Frame]]] = collections.deque()
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kv-receiver {self.address}", daemon=True)
        self._thread.start()

    # -- KVReceiver --------------------------------------------------------------------

    def register(self, request_id: str, dst_block_ids: Sequence[int], expected_layers: int) -> None:
        self._ledger.register(request_id, dst_block_ids, expected_layers)

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
        if self._closed:
            return
        self._closed = True
        for notice in self._ledger.close():
            self._post(notice)
        self._stop.set()
        self._wake()
        self._thread.join(_JOIN_S)
        if self._thread.is_alive():
            log.error("KV receiver %s: I/O thread did not stop within %.1f s", self.address, _JOIN_S)
            return  # its sockets are still in use; leave them to it
        with self._wake_lock:
            self._wake_tx.close(linger=0)

    @property
    def thread_alive(self) -> bool:
        return self._thread.is_alive()

    # -- I/O thread --------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(_IDLE_POLL_MS))
                if self._wake_rx in events:
                    _drain_wakeups(self._wake_rx)
                self._flush_outbox()
                self._handle_parked()
                if self._sock in events:
                    self._handle_socket()
            self._flush_outbox()  # the close() aborts
        except Exception:
            log.exception("KV receiver %s: I/O thread failed; failing pending transfers", self.address)
            self._ledger.close()
        finally:
            self._sock.close()
            self._wake_rx.close(linger=0)

    def _handle_socket(self) -> None:
        for _ in range(_BATCH):
            try:
                parts = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(parts)

    def _handle_parked(self) -> None:
        while self._parked and not self._stalled():
            self._handle_data(*self._parked.popleft())

    def _handle(self, parts: list[zmq.Frame]) -> None:
        peer = parts[0].bytes
        try:
            if len(parts) < 2:
                raise ValueError("no header frame")
            msg = decode(parts[1].buffer)
        except ValueError as e:
            # Not even a header: nothing to ack, and no credit is returned to a peer this broken.
            log.warning("KV receiver %s: dropped a bad message from %r: %s", self.address, peer, e)
            return
        if isinstance(msg, KVTransferHeader):
            if self._stalled() or self._parked:  # stalled (tests): hold data, keep its order
                self._parked.append((peer, msg, parts[2:]))
            else:
                self._handle_data(peer, msg, parts[2:])
        elif isinstance(msg, KVTransferHello):
            self._in_flight[peer] = 0  # a new (or reconnected) sender starts with a full window
            self._reply(peer, KVCreditGrant(credits=self._credits, checksum=frames.pick_checksum(msg.checksums)))
        elif isinstance(msg, KVTransferAbort):
            self._ledger.on_abort(msg, peer)
        else:
            log.warning("KV receiver %s: unexpected %s from %r", self.address, type(msg).__name__, peer)

    def _handle_data(self, peer: bytes, header: KVTransferHeader, tensor_frames: list[zmq.Frame]) -> None:
        in_flight = self._in_flight.get(peer, 0) + 1
        if in_flight > self._credits:
            # Not the owner's fault necessarily, so the registration is left alone; nothing is written.
            self._reply(peer, KVTransferAck(request_id=header.request_id, transfer_id=header.transfer_id,
                                            seq=header.seq, state=TransferState.FAILED, reason=FailReason.PROTOCOL,
                                            detail="sent beyond its credit window", credits=0))
            return
        self._in_flight[peer] = in_flight
        if len(tensor_frames) == 2:
            k, v = tensor_frames[0].buffer, tensor_frames[1].buffer
        else:
            k = v = b""  # wrong frame count: the ledger sees the size mismatch (or nothing, for an end marker)
        ack = self._ledger.apply(header, k, v, peer=peer)
        self._in_flight[peer] = in_flight - 1
        self._reply(peer, ack)

    def _reply(self, peer: bytes, msg: Message) -> None:
        try:
            self._sock.send_multipart([peer, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the sender is gone; EAGAIN: it stopped reading
            log.info("KV receiver %s: could not reply to %r: %s", self.address, peer, e)

    def _flush_outbox(self) -> None:
        while self._outbox:
            notice = self._outbox.popleft()
            self._reply(notice.peer, notice.message)

    def _stalled(self) -> bool:
        return self._faults is not None and self._faults.receiver_stalled

    # -- API threads -> I/O thread ---------------------------------------------------------

    def _post(self, notice: Notice | None) -> None:
        if notice is not None:
            self._outbox.append(notice)
            self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_tx.closed:
                return
            try:
                self._wake_tx.send(b"", flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # wake-ups are already queued; one is enough


class ZmqKVSender(KVSender):
    """Connects a DEALER to one receiver's `address` and sends blocks of `kv_caches` to it."""

    def __init__(self, kv_caches: KVCaches, address: str, *, context: zmq.Context | None = None,
                 faults: Faults | None = None, sender_id: str = "",
                 checksums: Sequence[ChecksumKind] = frames.CHECKSUMS,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self._book = SenderBook(kv_caches)
        self._blocks_per_message = max(1, max_message_bytes // frames.frame_bytes(self._book.geometry, 1))
        self._faults = faults
        self.address = address
        self._sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, _LINGER_MS)
        self._sock.connect(address)
        self._credits = 0
        self._checksum = ChecksumKind.CRC32  # until the receiver's grant names one (no send happens before)
        self._staging = frames.StagingPool(pin_memory=self._book.geometry.device.type == "cuda")
        self._lock = threading.Lock()
        # Queued until the connection is up; the grant that answers it is what the first send waits for.
        hello = KVTransferHello(sender_id=sender_id or uuid.uuid4().hex, checksums=tuple(c.value for c in checksums))
        self._sock.send(encode(hello), flags=zmq.NOBLOCK)

    @property
    def checksum(self) -> ChecksumKind:
        """The checksum the receiver chose (crc32 until its grant arrived)."""
        with self._lock:
            self._drain()
            return self._checksum

    @property
    def credits(self) -> int:
        """Messages this sender may still put in flight (after reading what has arrived)."""
        with self._lock:
            self._drain()
            return self._credits

    def send(self, request_id: str, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             deadline: float) -> None:
        src, dst = list(src_block_ids), list(dst_block_ids)
        with self._lock:
            self._check_open(request_id)
            self._book.check_send(request_id, layer, src, dst)
            step = self._blocks_per_message
            for i in range(0, len(src), step):
                self._send_one(request_id, layer, src[i : i + step], dst[i : i + step], deadline)

    def finish(self, request_id: str, deadline: float) -> None:
        with self._lock:
            self._check_open(request_id)
            self._drain()
            self._book.raise_if_failed(request_id)
            header = self._book.end_header(request_id)
            try:
                self._await_credit(request_id, deadline)
                self._put(header, [])
                self._book.commit(header)
                while not self._book.settled(request_id):
                    self._read_until(deadline, request_id, "no DONE from the receiver by the deadline")
                self._book.raise_if_failed(request_id)
            except TransferError as e:
                if e.reason is FailReason.TIMEOUT:
                    self._send_abort(request_id, f"sender gave up: {e.detail}")
                raise
            finally:
                self._book.forget(request_id)

    def abort(self, request_id: str, reason: str) -> None:
        with self._lock:
            if self._book.status(request_id) is not None and not self._sock.closed:
                self._send_abort(request_id, reason)
            self._book.forget(request_id)

    def close(self) -> None:
        with self._lock:
            if self._sock.closed:
                return
            for request_id in self._book.request_ids():  # unfinished: the receiver must not wait for them
                self._send_abort(request_id, "sender closed")
                self._book.forget(request_id)
            self._sock.close(linger=_LINGER_MS)

    # -- helpers (lock held) --------------------------------------------------------------

    def _send_one(self, request_id: str, layer: int, src: list[int], dst: list[int], deadline: float) -> None:
        self._await_credit(request_id, deadline)
        staging = None
        views = frames.cache_frames(self._book.kv_caches, layer, src)  # blocks in a row: sent from the cache
        if views is not None:
            k_frame, v_frame = views
        else:  # gathered once a credit is in hand: the credit window also bounds the staging memory
            staging = self._staging.take(frames.frame_bytes(self._book.geometry, len(src)))
            k_frame, v_frame = frames.gather(self._book.kv_caches, layer, src, out=staging)
        crc = frames.checksum(self._checksum, k_frame, v_frame)
        header = self._book.data_header(request_id, layer, dst, self._checksum, crc)
        sent = self._put(header, [k_frame, v_frame])
        if staging is not None and sent:
            self._staging.hold(_key(header), staging)
        elif staging is not None:
            self._staging.give(staging)
        self._book.commit(header)

    def _await_credit(self, request_id: str, deadline: float) -> None:
        self._drain()
        self._book.raise_if_failed(request_id)
        while self._credits <= 0:
            self._read_until(deadline, request_id,
                             f"no credit from {self.address} by the deadline: the receiver is not draining")
            self._book.raise_if_failed(request_id)

    def _read_until(self, deadline: float, request_id: str, timeout_detail: str) -> None:
        """Wait for one batch of incoming messages, or raise TIMEOUT at `deadline`."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferError(request_id, FailReason.TIMEOUT, timeout_detail)
        if self._sock.poll(max(1, math.ceil(remaining * 1000)), zmq.POLLIN):
            self._drain()

    def _put(self, header: KVTransferHeader, tensor_frames: list[np.ndarray]) -> bool:
        """Put one message on the wire (faults applied); False if a fault dropped it."""
        rule = self._faults.take(header) if self._faults is not None else None
        if rule is not None and rule.action is FaultAction.DROP:
            return False  # lost on the way: no credit spent, no ack will come
        if rule is not None and rule.action is FaultAction.CORRUPT:
            tensor_frames = [corrupted(tensor_frames[0]), *tensor_frames[1:]]
        if rule is not None and rule.action is FaultAction.DELAY:
            time.sleep(rule.delay_s)
        try:
            self._sock.send_multipart([encode(header), *tensor_frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # cannot happen while credits hold; never block without a deadline if it does
            raise TransferError(header.request_id, FailReason.PROTOCOL, "send queue full despite credits") from None
        self._credits -= 1
        return True

    def _drain(self) -> None:
        """Apply every ack, credit grant and abort that has arrived; never blocks."""
        while True:
            try:
                data = self._sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(data)
            except ValueError as e:
                log.warning("KV sender -> %s: dropped a bad message: %s", self.address, e)
                continue
            if isinstance(msg, KVTransferAck):
                self._credits += msg.credits
                self._staging.release((msg.request_id, msg.transfer_id, msg.seq))
                self._book.on_ack(msg)
            elif isinstance(msg, KVCreditGrant):
                self._credits += msg.credits
                self._checksum = msg.checksum
            elif isinstance(msg, KVTransferAbort):
                self._book.on_abort(msg)
            else:
                log.warning("KV sender -> %s: unexpected %s", self.address, type(msg).__name__)

    def _send_abort(self, request_id: str, reason: str) -> None:
        msg = KVTransferAbort(request_id=request_id, transfer_id=self._book.transfer_id(request_id), reason=reason)
        try:
            self._sock.send(encode(msg), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.info("KV sender -> %s: abort of %r not sent: %s", self.address, request_id, e)

    def _check_open(self, request_id: str) -> None:
        if self._sock.closed:
            raise TransferError(request_id, FailReason.CLOSED, "sender is closed")


def _key(header: KVTransferHeader) -> tuple[str, int, int]:
    return header.request_id, header.transfer_id, header.seq


def _drain_wakeups(sock: zmq.Socket) -> None:
    while True:
        try:
            sock.recv(flags=zmq.NOBLOCK)
        except zmq.Again:
            return


__all__ = ["DEFAULT_CREDITS", "ZmqKVReceiver", "ZmqKVSender"]
