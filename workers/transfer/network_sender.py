"""The sending end of the KV control plane: a prefill worker's DEALER to one decode worker's
receiver, with credit-based flow control, liveness and resync, and the handshake's keys.
The protocol both ends speak is described in `control` (its module docstring); this is the
side that connects, waits for credits and verdicts, and reconnects after a link is lost.
"""

from __future__ import annotations

import abc
import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from pdserve.workers.fault_seam import FaultAction, TransferFaults
from pdserve.workers.link_monitor import SMALL_FRAME_BYTES, LinkMonitor, apply_heartbeats, apply_limits
from pdserve.workers.messages import (
    MAX_MESSAGE_BYTES,
    ChecksumKind,
    FailReason,
    KVCreditGrant,
    KVHelloRefusal,
    KVTransferAbort,
    KVTransferAck,
    KVTransferHeader,
    KVTransferHello,
    Message,
    decode,
    encode,
)
from pdserve.workers.transfer import auth, frames
from pdserve.workers.transfer.auth import ClusterSecret, RefusalCounts, SeqWindow
from pdserve.workers.transfer.base import KVSender, TransferError
from pdserve.workers.transfer.control import CONNECT_BUDGET_S, LINGER_MS
from pdserve.workers.transfer.frames import KVCaches
from pdserve.workers.transfer.ledger import SenderBook

log = logging.getLogger(__name__)

# A wait's longest sleep (for a credit, the verdict, the data channel): how soon it sees that `close`,
# called from another thread, waits for the lock it holds.
CLOSE_CHECK_S = 0.1


class NetworkSender(KVSender):
    """`send`, `finish`, `abort` and `close` over a DEALER to one receiver's `address`.

    For the backends that differ only in how a data message's bytes travel: a subclass implements
    `_send_message` (one message of at most `_blocks_per_message` blocks) and may hook `_on_ack`,
    `_on_link_lost` and `_on_resync`. `routing_id` names the DEALER (None: ZeroMQ picks one per
    connection); a subclass may change it (and `_sender_id`) in `_on_link_lost` for the next connection.
    `connect_budget_s`: how long a wait may last while no connection is up (module docstring).

    `num_links_lost` counts connections lost after they were up; `num_resyncs` the credit grants that
    answered a hello on a replacement connection (module docstring, "Liveness and resync").

    Authentication (`auth`): the hello goes under a key derived from `secret` with a fresh nonce and the
    model's `fingerprint`; the receiver's grant names its own nonce, and every later message either way
    is under that connection's key, numbered. Aborts wait for the grant (before it there is no key).
    A receiver that refuses the hello (another model, another secret, or an NCCL receiver that will not
    pair with it) fails every send on this connection with PROTOCOL and its reason. `refusals` counts
    what this sender dropped.
    """

    def __init__(self, kv_caches: KVCaches, address: str, *, context: zmq.Context[zmq.Socket[bytes]] | None,
                 faults: TransferFaults | None, sender_id: str, checksums: Sequence[ChecksumKind],
                 max_message_bytes: int, routing_id: bytes | None = None, connect_budget_s: float = CONNECT_BUDGET_S,
                 secret: ClusterSecret | None = None, fingerprint: str = "") -> None:
        self._book = SenderBook(kv_caches)
        self._blocks_per_message = max(1, max_message_bytes // frames.frame_bytes(self._book.geometry, 1))
        self._faults = faults
        self.address = address
        self._context = context or zmq.Context.instance()
        self._routing_id = routing_id
        self._sender_id = sender_id
        self._checksums = tuple(c.value for c in checksums)
        self._connect_budget_s = connect_budget_s
        self._credits = 0
        self._checksum = ChecksumKind.CRC32  # until the receiver's grant names one (no send happens before)
        self._lock = threading.Lock()
        self._closed = False
        self._closing = threading.Event()  # `close` was called: a call waiting on the peer gives up
        self.num_links_lost = 0
        self.num_resyncs = 0
        self._resync_due = False  # a link was lost: the next grant completes a resync
        self._secret = auth.resolve(secret)
        self._hello_key = self._secret.derive(auth.KV_HELLO)
        self._fingerprint = fingerprint
        self.refusals = RefusalCounts()
        # This connection's: set by `_open`, the key by the grant.
        self._nonce = ""
        self._session_key: bytes | None = None
        self._tx = 0
        self._rx = SeqWindow()
        self._deferred: list[KVTransferAbort] = []  # aborts waiting for the connection's key
        self._refused: str | None = None  # why the receiver refused this connection's hello
        self._sock, self._monitor, self._poller = self._open()

    def link_down_s(self) -> float:
        with self._lock:
            if self._closed:
                return 0.0
            self._drain()
            return 0.0 if self._monitor.connected else time.monotonic() - self._monitor.changed_at

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

    @property
    def link_up(self) -> bool:
        """Whether the connection to the receiver is up now (ZMTP handshake done, not lost since)."""
        with self._lock:
            self._drain()
            return self._monitor.connected and not self._closed

    # -- KVSender ------------------------------------------------------------------------

    def send(self, request_id: str, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             deadline: float) -> None:
        src, dst = list(src_block_ids), list(dst_block_ids)
        with self._lock:
            self._check_open(request_id)
            self._drain()
            self._book.check_send(request_id, layer, src, dst)
            step = self._blocks_per_message
            for i in range(0, len(src), step):
                self._send_message(request_id, layer, src[i : i + step], dst[i : i + step], deadline)

    def finish(self, request_id: str, deadline: float) -> None:
        with self._lock:
            self._check_open(request_id)
            self._drain()
            self._book.raise_if_failed(request_id)
            header = self._book.end_header(request_id)
            try:
                self._await_credit(request_id, deadline)
                if self._take_fault(header) is not FaultAction.DROP:
                    self._put_header(header)
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
            if self._book.status(request_id) is not None and not self._closed:
                self._send_abort(request_id, reason)
            self._book.forget(request_id)

    def close(self) -> None:
        # A call waiting on the receiver holds the lock until its deadline (30 s): it sees this within
        # CLOSE_CHECK_S and raises CLOSED, so that closing stays bounded (KVSender.close).
        self._closing.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for request_id in self._book.request_ids():  # unfinished: the receiver must not wait for them
                self._send_abort(request_id, "sender closed")
                self._book.forget(request_id)
            self._monitor.close()
            self._sock.close(linger=LINGER_MS)

    # -- for the backend (lock held) ---------------------------------------------------------

    @abc.abstractmethod
    def _send_message(self, request_id: str, layer: int, src: list[int], dst: list[int], deadline: float) -> None:
        """Put one data message on its way: wait for a credit (`_await_credit`), move the bytes, send the
        header (`_put_header`, unless `_take_fault` says DROP), `self._book.commit` it."""

    def _on_ack(self, ack: KVTransferAck) -> None:
        """An ack arrived (before the book sees it): the message's bytes are no longer needed."""

    def _on_link_lost(self, detail: str) -> None:
        """The connection was lost; every unsettled transfer has failed. Drop what waited for acks; runs before
        the replacement connection is opened (with `_routing_id` and `_sender_id` as they are on return)."""

    def _on_resync(self) -> None:
        """The receiver granted credits on a replacement connection: the link works again."""

    def _take_fault(self, header: KVTransferHeader) -> FaultAction | None:
        """The fault a test injects into this message (the test seam, workers/fault_seam.py; None
        without one): DROP or CORRUPT for the caller to apply; a DELAY is slept here."""
        if self._faults is None:
            return None
        fault = self._faults.on_send(header)
        if fault is None:
            return None
        if fault.action is FaultAction.DELAY:
            time.sleep(fault.delay_s)
        return fault.action

    def _put_header(self, header: KVTransferHeader, tensor_frames: Sequence[Any] = ()) -> None:
        """Send `header` (and zero-copy frames after it) under the connection's MAC; spends a credit."""
        try:
            self._send_sealed([encode(header), *tensor_frames])
        except zmq.ZMQError as e:  # cannot happen while credits hold; never block without a deadline if it does
            raise TransferError(header.request_id, FailReason.PROTOCOL, f"not sent despite credits: {e}") from None
        self._credits -= 1

    def _send_sealed(self, parts: Sequence[Any]) -> None:
        """Send one message under this connection's key (the grant came: credits or a key are in hand)."""
        assert self._session_key is not None, "no message but a hello before the receiver's grant"
        seq = self._tx + 1
        tag = auth.seal(self._session_key, auth.KV_TO_RECEIVER, seq, parts)
        self._sock.send_multipart([tag, *parts], flags=zmq.NOBLOCK, copy=False)
        self._tx = seq  # only once sent: a number the receiver never saw is no gap it minds either

    def _await_credit(self, request_id: str, deadline: float) -> None:
        self._drain()
        self._raise_if_refused(request_id)
        self._book.raise_if_failed(request_id)
        while self._credits <= 0:
            self._read_until(deadline, request_id,
                             f"no credit from {self.address} by the deadline: the receiver is not draining")

    def _read_until(self, deadline: float, request_id: str, timeout_detail: str) -> None:
        """Wait for one batch of incoming messages or link events, then apply them.

        Raises the request's failure once it has one (PEER_LOST when its link was lost), PEER_LOST when no
        connection has been up for `connect_budget_s`, TIMEOUT at `deadline`, whichever comes first;
        PROTOCOL when the receiver refused this sender.
        """
        self._raise_if_refused(request_id)
        self._book.raise_if_failed(request_id)
        now = time.monotonic()
        remaining = deadline - now
        if not self._monitor.connected:
            down_s = now - self._monitor.changed_at
            if down_s >= self._connect_budget_s:
                what = "lost" if self._resync_due else "never made"
                raise TransferError(request_id, FailReason.PEER_LOST,
                                    f"no connection to {self.address} for {down_s:.1f} s (it was {what}): "
                                    "the receiver is dead, hung or unreachable")
            remaining = min(remaining, self._connect_budget_s - down_s)
        elif remaining <= 0:
            raise TransferError(request_id, FailReason.TIMEOUT, timeout_detail)
        if remaining <= 0:
            raise TransferError(request_id, FailReason.TIMEOUT, timeout_detail)
        if self._poller.poll(max(1, math.ceil(self._sleep_s(request_id, remaining) * 1000))):
            self._drain()
            self._raise_if_refused(request_id)
            self._book.raise_if_failed(request_id)

    def _sleep_s(self, request_id: str, remaining: float) -> float:
        """How long a wait with `remaining` seconds left may sleep before it looks again; CLOSED once
        `close` was called (from another thread, which waits for the lock this wait holds)."""
        if self._closing.is_set():
            raise TransferError(request_id, FailReason.CLOSED, "sender is closed")
        return min(remaining, CLOSE_CHECK_S)

    def _raise_if_refused(self, request_id: str) -> None:
        if self._refused is not None:
            raise TransferError(request_id, FailReason.PROTOCOL, self._refused)

    def _drain(self) -> None:
        """Apply every link event, ack, credit grant and abort that has arrived; never blocks."""
        if self._closed:
            return
        self._poll_link()
        while True:
            try:
                parts = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self._authentic(parts)
            if msg is None:
                continue
            if isinstance(msg, KVTransferAck):
                self._credits += msg.credits
                self._on_ack(msg)
                self._book.on_ack(msg)
            elif isinstance(msg, KVCreditGrant):
                # The one answer to this connection's hello: a full window, whatever the last connection left.
                self._credits = msg.credits
                self._checksum = msg.checksum
                if self._resync_due:
                    self._resync_due = False
                    self.num_resyncs += 1
                    log.info("KV sender -> %s: link resynchronized (%d credits)", self.address, msg.credits)
                    self._on_resync()
                deferred, self._deferred = self._deferred, []
                for abort in deferred:
                    self._send_abort(abort.request_id, abort.reason, abort.transfer_id)
            elif isinstance(msg, KVTransferAbort):
                self._book.on_abort(msg)
            else:
                log.warning("KV sender -> %s: unexpected %s", self.address, type(msg).__name__)

    def _authentic(self, parts: list[bytes]) -> Message | None:
        """The message in `parts` ([auth, body]) if its MAC checks under this connection's key (a grant:
        the key it completes) and its number is new; None (counted) otherwise. A refusal of our hello is
        acted on here."""
        try:
            if len(parts) != 2:
                raise ValueError(f"{len(parts)} frames")
            tag, body = parts
            msg = decode(body)
        except ValueError as e:
            self._count_forged(f"not a message: {e}")
            return None
        if self._session_key is None:  # only the answer to our hello can come now
            # (A grant names the receiver's nonce, bound to ours through the key its MAC is under.)
            if not (isinstance(msg, KVCreditGrant) or isinstance(msg, KVHelloRefusal) and msg.nonce == self._nonce):
                self._count_forged(f"{type(msg).__name__} before the grant")
                return None
            if isinstance(msg, KVHelloRefusal) and not msg.receiver_nonce:  # unauthenticated: a hint only
                self._refuse(f"{msg.reason} (an unauthenticated notice)")
                return None
            other = msg.receiver_nonce if isinstance(msg, KVHelloRefusal) else msg.nonce
            key = auth.session_key(self._secret, self._nonce, other)
            if (seq := auth.check(key, auth.KV_TO_SENDER, tag, [body])) is None:
                self._count_forged(f"{type(msg).__name__} whose MAC does not check")
                return None
            if isinstance(msg, KVHelloRefusal):
                self._refuse(msg.reason)
                return None
            self._session_key = key
            self._rx.take(seq)
            return msg
        if (seq := auth.check(self._session_key, auth.KV_TO_SENDER, tag, [body])) is None:
            self._count_forged(f"{type(msg).__name__} whose MAC does not check")
            return None
        if not self._rx.fresh(seq):
            self.refusals.replayed += 1
            log.warning("KV sender -> %s: refused a replayed %s (#%d)", self.address, type(msg).__name__, seq)
            return None
        self._rx.take(seq)
        return msg

    def _count_forged(self, why: str) -> None:
        self.refusals.forged += 1
        log.warning("KV sender -> %s: dropped a message: %s", self.address, why)

    def _refuse(self, reason: str) -> None:
        """The receiver refused this connection's hello: every send on it fails with the reason."""
        self._refused = f"the KV receiver at {self.address} refused this sender: {reason}"
        log.error("KV sender -> %s: %s", self.address, self._refused)
        self._book.fail_pending(FailReason.PROTOCOL, self._refused)

    def _poll_link(self) -> None:
        for event in self._monitor.poll():
            if event.lost:
                self._link_lost(str(event))
                return  # the rest are the old socket's, which is gone

    def _link_lost(self, why: str) -> None:
        """The connection went down: fail what was in flight on it, and start over on a new socket."""
        self.num_links_lost += 1
        detail = f"connection to {self.address} lost ({why}): the receiver died, hung or is unreachable"
        log.warning("KV sender -> %s: %s", self.address, detail)
        self._reconnect(FailReason.PEER_LOST, detail, f"sender lost the link: {why}")

    def _reconnect(self, reason: FailReason, detail: str, abort_reason: str) -> None:
        """Fail what is in flight with `reason` (and abort it on the receiver, saying `abort_reason`),
        and start over on a new socket (and, where a subclass changes it in `_on_link_lost`, under a
        new routing id): hello, grant, resync."""
        self._credits = 0  # those in flight will not come back; the next grant is a full window
        failed = self._book.fail_pending(reason, detail)
        self._on_link_lost(detail)
        self._deferred.clear()  # for the old connection's receiver session, which is gone
        # A new socket, not the old one's own reconnect: nothing it queued or received (stale data, acks that
        # would return credits of the old window) crosses over to the new connection.
        self._monitor.close()
        self._sock.close(linger=0)
        self._sock, self._monitor, self._poller = self._open()
        self._resync_due = True
        for request_id, transfer_id in failed:  # after the grant: a receiver that only hung frees these then
            self._send_abort(request_id, abort_reason, transfer_id)

    def _open(self) -> tuple[zmq.Socket[bytes], LinkMonitor, zmq.Poller]:
        """A DEALER to `address`, with heartbeats and a monitor, and this connection's hello queued on it."""
        sock = self._context.socket(zmq.DEALER)
        if self._routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, self._routing_id)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        apply_heartbeats(sock)
        # Only acks, grants and aborts come back; data goes out within the credits (+ aborts).
        apply_limits(sock, max_frame_bytes=MAX_MESSAGE_BYTES + SMALL_FRAME_BYTES)
        monitor = LinkMonitor(sock)  # before connect: it sees the first handshake
        sock.connect(self.address)
        # Queued until the connection is up; the grant that answers it is what the first send waits for.
        self._nonce, self._session_key, self._tx, self._rx, self._refused = auth.new_nonce(), None, 1, SeqWindow(), None
        hello = encode(KVTransferHello(sender_id=self._sender_id, checksums=self._checksums, nonce=self._nonce,
                                       fingerprint=self._fingerprint))
        sock.send_multipart([auth.seal(self._hello_key, auth.KV_HELLO, 1, [hello]), hello], flags=zmq.NOBLOCK)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor.socket, zmq.POLLIN)
        return sock, monitor, poller

    def _send_abort(self, request_id: str, reason: str, transfer_id: int | None = None) -> None:
        tid = self._book.transfer_id(request_id) if transfer_id is None else transfer_id
        msg = KVTransferAbort(request_id=request_id, transfer_id=tid, reason=reason)
        if self._session_key is None:  # no key yet to send it under: it goes after the grant
            self._deferred.append(msg)
            return
        try:
            self._send_sealed([encode(msg)])
        except zmq.ZMQError as e:
            log.info("KV sender -> %s: abort of %r not sent: %s", self.address, request_id, e)

    def _check_open(self, request_id: str) -> None:
        if self._closed:
            raise TransferError(request_id, FailReason.CLOSED, "sender is closed")
