"""KV transport over ZeroMQ/TCP between any two hosts: the bytes travel with their header.

The sockets, credits, acks and aborts are the shared control plane (`control`:
ROUTER on the receiver, a DEALER per sender). What this backend adds is the
data path on the same connection.

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
4 MiB: on loopback 2 MiB messages moved fewer bytes per second (per-message
work on both ends), and 8 or 16 MiB no more (bench/kv_transfer.py; numbers:
docs/performance.md, "KV transfer").

Memory: each side holds at most `credits` messages of a peer,
`credits x max_message_bytes` bytes (32 MiB by default). The receiver drops a
connection that sends a frame over `max_frame_bytes` (ZMQ_MAXMSGSIZE, 64 MiB)
before allocating for it.

Authentication (`auth`, `control`): every message, its K and V frames
included, carries an HMAC-SHA256 tag under its connection's key, checked on
the I/O thread before anything is decoded or written; a hello names the
sender's model fingerprint, and the receiver refuses another model's.

Threads: the receiver's I/O thread (the control plane's) also checks and
writes the data, in arrival order. The sender has no thread.
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Sequence

import zmq

from pdserve.workers.fault_seam import FaultAction, TransferFaults, corrupted
from pdserve.workers.messages import ChecksumKind, FailReason, KVTransferAck, KVTransferHeader, KVTransferHello
from pdserve.workers.transfer import frames
from pdserve.workers.transfer.auth import ClusterSecret, RefusalCounts
from pdserve.workers.transfer.control import (
    CONNECT_BUDGET_S,
    DEFAULT_CREDITS,
    DEFAULT_MAX_FRAME_BYTES,
    ReceiverControl,
    message_key,
)
from pdserve.workers.transfer.frames import KVCaches
from pdserve.workers.transfer.ledger import LedgerReceiver, Notice, ReceiverLedger, refusal
from pdserve.workers.transfer.network_sender import NetworkSender

DEFAULT_MAX_MESSAGE_BYTES = 4 << 20


class ZmqKVReceiver(LedgerReceiver):
    """Binds a ROUTER at `bind` (use port `*` for any free one; see `address`) and writes into `kv_caches`.

    Takes messages only from senders that hold `secret` (None: `auth.default_secret()`) and, when both
    ends name one, run the model of `fingerprint`."""

    def __init__(self, kv_caches: KVCaches, bind: str = "tcp://127.0.0.1:*", *, credits: int = DEFAULT_CREDITS,
                 context: zmq.Context[zmq.Socket[bytes]] | None = None, faults: TransferFaults | None = None,
                 secret: ClusterSecret | None = None, fingerprint: str = "",
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        super().__init__(ReceiverLedger(kv_caches))
        self._faults = faults
        self._in_flight: dict[bytes, int] = {}  # peer identity -> its messages not yet acked (I/O thread)
        # Data read while a test stalls the receiver: at most `credits` messages per well-behaved peer.
        self._parked: collections.deque[tuple[bytes, KVTransferHeader, list[zmq.Frame]]] = collections.deque()
        self._control = ReceiverControl(self._ledger, bind, credits=credits, context=context,
                                        on_header=self._on_header, on_hello=self._on_hello, on_turn=self._unpark,
                                        secret=secret, fingerprint=fingerprint, max_frame_bytes=max_frame_bytes)
        self.address = self._control.address
        self._control.start()

    def _close_backend(self) -> None:
        self._control.close()

    @property
    def thread_alive(self) -> bool:
        return self._control.alive

    @property
    def refusals(self) -> RefusalCounts:
        """What the receiver refused from peers (forged, replayed, another model, dropped connections)."""
        return self._control.refusals

    def _post(self, notice: Notice | None) -> None:
        if notice is not None:
            self._control.post(notice.peer, notice.message)

    # -- I/O thread --------------------------------------------------------------------

    def _on_hello(self, peer: bytes, hello: KVTransferHello, frame: zmq.Frame) -> str | None:
        self._in_flight.pop(peer, None)  # a new (or reconnected) sender starts with a full window
        return None

    def _on_header(self, peer: bytes, header: KVTransferHeader, tensor_frames: list[zmq.Frame]) -> None:
        if self._stalled() or self._parked:  # stalled (tests): hold data, keep its order
            self._parked.append((peer, header, tensor_frames))
        else:
            self._handle_data(peer, header, tensor_frames)

    def _unpark(self) -> None:
        while self._parked and not self._stalled():
            self._handle_data(*self._parked.popleft())

    def _handle_data(self, peer: bytes, header: KVTransferHeader, tensor_frames: list[zmq.Frame]) -> None:
        in_flight = self._in_flight.get(peer, 0) + 1
        if in_flight > self._control.credits:
            # Not the owner's fault necessarily, so the registration is left alone; nothing is written.
            self._control.reply(peer, refusal(header, FailReason.PROTOCOL, "sent beyond its credit window", credits=0))
            return
        self._in_flight[peer] = in_flight
        k: memoryview | bytes
        v: memoryview | bytes
        if len(tensor_frames) == 2:
            k, v = tensor_frames[0].buffer, tensor_frames[1].buffer
        else:
            k = v = b""  # wrong frame count: the ledger sees the size mismatch (or nothing, for an end marker)
        ack = self._ledger.apply(header, k, v, peer=peer)
        if in_flight > 1:
            self._in_flight[peer] = in_flight - 1
        else:  # only peers with messages in hand are kept: a hello per connection adds none for good
            del self._in_flight[peer]
        self._control.reply(peer, ack)

    def _stalled(self) -> bool:
        return self._faults is not None and self._faults.receiver_stalled


class ZmqKVSender(NetworkSender):
    """Connects a DEALER to one receiver's `address` and sends blocks of `kv_caches` to it."""

    def __init__(self, kv_caches: KVCaches, address: str, *, context: zmq.Context[zmq.Socket[bytes]] | None = None,
                 faults: TransferFaults | None = None, sender_id: str = "",
                 checksums: Sequence[ChecksumKind] = frames.CHECKSUMS,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 connect_budget_s: float = CONNECT_BUDGET_S, secret: ClusterSecret | None = None,
                 fingerprint: str = "") -> None:
        super().__init__(kv_caches, address, context=context, faults=faults, sender_id=sender_id or uuid.uuid4().hex,
                         checksums=checksums, max_message_bytes=max_message_bytes, connect_budget_s=connect_budget_s,
                         secret=secret, fingerprint=fingerprint)
        self._staging = frames.StagingPool(pin_memory=self._book.geometry.device.type == "cuda")

    def _send_message(self, request_id: str, layer: int, src: list[int], dst: list[int], deadline: float) -> None:
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
        fault = self._take_fault(header)
        if fault is not FaultAction.DROP:  # a dropped message is lost on the way: no credit spent, no ack
            if fault is FaultAction.CORRUPT:
                k_frame = corrupted(k_frame)
            self._put_header(header, [k_frame, v_frame])
        if staging is not None and fault is FaultAction.DROP:
            self._staging.give(staging)
        elif staging is not None:  # until the ack: then the receiver has every byte
            self._staging.hold(message_key(header), staging)
        self._book.commit(header)

    def _on_ack(self, ack: KVTransferAck) -> None:
        self._staging.release((ack.request_id, ack.transfer_id, ack.seq))

    def _on_link_lost(self, detail: str) -> None:
        self._staging.forget_held()  # their acks will not come


__all__ = ["DEFAULT_CREDITS", "DEFAULT_MAX_MESSAGE_BYTES", "ZmqKVReceiver", "ZmqKVSender"]
