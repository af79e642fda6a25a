"""KV transport whose bytes move with torch.distributed point-to-point send/recv: NCCL between GPUs, gloo on CPU.

Two planes per (prefill sender, decode receiver) pair:

* Control, the ZeroMQ control plane both network backends share (`control`): the receiver binds one
  ROUTER, each sender connects one DEALER. Hello and credit grant, one msgpack `KVTransferHeader` per
  data message (with the checksum of its bytes), acks (which return credits and carry the receiver's
  verdict), aborts both ways, and `finish`'s end marker.
* Data: the K and V bytes of one message, as one flat uint8 tensor (K blocks then V blocks, the layout
  of `frames.gather`), `send` by the sender, `recv` by the receiver, on a process group of two ranks
  private to the pair: the receiver is rank 0, the sender rank 1 (`nccl_channel`).

Groups. No `init_process_group`: a decode worker serves many prefill workers (and a prefill worker may
feed many decode workers), so no transport may own the global default group, and a pair must come and
go without the others. Each end builds its rank of the pair's group directly with the c10d backend
classes that `init_process_group` and `new_group` wrap: `ProcessGroupGloo(store, rank, 2, options)` when
the caches are on the CPU, `ProcessGroupNCCL(store, rank, 2, options)` when they are on CUDA (`backend=`
forces one; gloo with CUDA caches stages through host memory), on `PrefixStore("pdserve-kv/<key>",
store)`, `key` being the sender's random id (its DEALER's routing id, sent in its hello). Nothing is
registered globally: `dist.is_initialized()` stays False.

The store (the two or three keys a rendezvous exchanges) is the receiver's, served on its ROUTER; each
end sees it through a `torch.distributed.Store` subclass (c10d calls Python stores through its
`PythonStore` trampoline): `LocalStore` for the receiver's rank, `StoreClient` (its own DEALER) for
the sender's (both in `nccl_store`). So the receiver's address is just its ROUTER endpoint. Not a
`TCPStore`: that needs a second port and, worse, its connection setup formats peer addresses with a
reverse DNS lookup, which stalls a connection until the lookup times out on a host whose DNS resolver
is unreachable.

Building a rank is a rendezvous that blocks until both ranks are there (at most `group_timeout_s`), so
each end does it on a thread of its own: the receiver on the pair's thread when the hello arrives, the
sender on a thread its constructor starts. Both then pass a one-byte probe, sender to receiver: that
makes NCCL create its lazily built p2p communicator while both sides wait for it, so that a later
`send` only enqueues work (and it proves the channel on gloo). The pair's store keys are then dropped.

Matching headers and tensors. The sender posts a message's tensor `send` first, then its header. ZeroMQ
keeps headers in order per connection; the receiver's pair thread posts one `recv` per data header, in
header order, sized from the header's own claims (2 x num_blocks x block_shape x dtype size) into a
reused staging buffer. The tag is a per-pair message counter that both ends advance per tensor (gloo
matches on it; NCCL ignores tags and matches p2p operations in posting order). So every data header a
receiver gets is received in full, whatever the ledger then thinks of it (unknown request, wrong
geometry, aborted transfer, beyond the credit window): the two streams stay aligned and the bytes are
discarded. Only a header whose size cannot be known (an unknown dtype, a size over `max_message_bytes`)
or a failed recv breaks the pair (see below). End markers carry no tensor.

Verification. After its recv, a message goes to the shared `ReceiverLedger`, as in the ZeroMQ receiver:
it checks the header against the registration and the cache geometry and only then writes into the
destination blocks. Checksums are negotiated at hello. A sender that does not ask for them
(`verify_checksums=False`, the default) offers NONE besides the kinds it computes; a receiver that does not
ask for them either (its default too) grants NONE: neither end hashes, and the bytes go from device staging
into the cache on the device. Either end's `verify_checksums=True` makes the grant name a real checksum
(crc32, or xxh3_64 where both ends have xxhash): the sender hashes every message and the receiver verifies
it before writing, which on CUDA costs a device-to-host copy of every message on both ends (and the write
is then host-to-device). A header without a checksum sent to a receiver that verifies fails its transfer
(PROTOCOL). `num_checksummed` counts, on each end, the messages it hashed. Why off by default: NVLink and
InfiniBand check every packet at the link layer (CRC, with retransmission); the control messages that say
which bytes go where (headers, acks, aborts) carry a MAC either way; and a crc32/xxh3 was never a defence
against someone who can write into the data channel (docs/security-data-plane.md). What it still catches
when asked for: bytes corrupted in memory or by a buggy peer, and what TCP's weak checksum misses on gloo.

Flow control: the control plane's credits (hello -> grant; one credit per data message or end marker,
returned by its ack). A sender holds a message's staging buffer (and its send's Work) until the ack, so
credits bound staging memory; a receiver has one staging buffer per pair.

Threads. Receiver: the control plane's I/O thread owns the ROUTER (hellos, headers, aborts, outgoing acks
and aborts, and the store's requests), and one thread per pair forms the group, then receives that
pair's tensors in order, applies them to the ledger and queues each ack for the I/O thread. Sender: only
the short-lived group-forming thread; otherwise it reads acks when called, and its calls are serialized
by a lock.

Streams (CUDA; `streams`). A pair thread runs with a copy stream of its own current, never the engine's:
its recv is ordered after its previous writes out of the same staging (ProcessGroupNCCL's stream waits for
the caller's current stream), `work.wait()` orders the writes after the recv, and the ledger waits on the
host, before the transfer ends in any way, for the event after the last of those writes (the decode
engine then reads the blocks, or they go back to the pool); no message waits for its write, and no
`synchronize()` waits for the decode engine's kernels. The sender uses the caller's current stream: the
prefill worker's link thread (`send_queue`) has a copy stream of its own that waits, on the device, for an
event the engine thread recorded after the step that wrote the blocks; NCCL's send waits for the gather.

Deadlines and limitations.
* gloo cannot cancel or poll a posted recv: `Work.is_completed()` stays False until `wait()`, and neither
  `abort()` nor `shutdown()` ends a `wait()`; a `wait(timeout)` that expires closes the pair's
  connection. So the pair thread waits in `wait()`, bounded by the group timeout, after which the pair is
  broken. Because a tensor is posted before its header, that wait is normally sub-millisecond; it is
  long only when a sender is alive but stuck mid-message (a dead sender ends it at once: connection
  closed). NCCL: the pair thread polls `Work.is_completed()` and stays responsive; a recv still pending
  at the group timeout, or at close, aborts the pair's communicator (`ProcessGroupNCCL.abort()`), the only
  way to cancel a stuck NCCL recv. ProcessGroupNCCL's watchdog also acts on operations past the group
  timeout as TORCH_NCCL_ASYNC_ERROR_HANDLING says (by default: tear down the process); keep
  `group_timeout_s` well above the workers' transfer deadlines. The NCCL path is untested here: this repo's
  CI has no GPU, and one GPU cannot host both ranks of an NCCL communicator.
* A broken pair (group not formed in time, a failed send or recv, an unsizable header) stays broken:
  every later message on it fails its transfer with CLOSED. The sender's next send forms a new pair,
  as after a lost link (a new key, routing id and connection: `num_repairs`), so one bad message costs
  the transfers in flight on the old pair, not every later one.
* A lost control link (the control plane's heartbeats or monitor: see `control`) ends the pair on the
  sender's side too, since headers lost with the connection would leave the two streams misaligned.
  The sender then takes a new key (and routing id), says hello on its new connection, and once the
  receiver grants credits forms a new pair with it: the link resyncs as the ZeroMQ backend's does.
* Abort and release never wait for a recv: received bytes land in staging, and the ledger writes into the
  cache only under its lock while the transfer is PENDING. close() joins every thread within ~2 s; a thread
  stuck in a gloo wait or in group formation is left behind (daemon) and logged, as the ZeroMQ receiver
  does with its I/O thread.
* A ROUTER is not told that a peer left: a restarted sender, or one that resynced or re-paired, leaves
  its old pair (thread and group) behind. At most `max_senders` pairs are kept: a hello past it evicts a
  broken pair, else the longest-idle one with nothing in flight (its thread ends, its group closes; a live
  sender of it hears CLOSED at its next message and pairs again), and is refused only when every pair is
  busy. A sender whose sender id is not its routing id (a ZeroMQ-transport sender) is refused at its hello.
  A refused sender is told why (`KVHelloRefusal`) and its sends fail at once.
* Authentication (`auth`, `control`): every control message (hello, headers, acks, aborts, end markers)
  carries an HMAC-SHA256 tag under its connection's key, and the store's requests and replies one under a
  key derived from the cluster secret (numbered per store connection; a reply is bound to its request).
  A header's tag covers where its tensor goes (request, transfer, seq, layer, blocks, dtype, shape) and
  its checksum when one was negotiated (none by default), but not the tensor itself: the bytes on the
  NCCL or gloo channel carry no MAC (docs/security-data-plane.md says what that leaves open). The store keeps at
  most 4096 small entries. A receiver bound to a wildcard address advertises it as is, as the
  ZeroMQ backend does. Each gloo rank listens on the address its peer reaches it by (`gloo_hostname`
  overrides).
"""

# One file (over 450 lines): the receiver and sender are the two ends of the protocol described above, read together.

from __future__ import annotations

import collections
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq

from pdserve.workers.fault_seam import FaultAction, TransferFaults
from pdserve.workers.link_monitor import SMALL_FRAME_BYTES
from pdserve.workers.messages import (
    MAX_MESSAGE_BYTES,
    ChecksumKind,
    FailReason,
    KVTransferAck,
    KVTransferHeader,
    KVTransferHello,
)
from pdserve.workers.transfer import frames
from pdserve.workers.transfer.auth import ClusterSecret, RefusalCounts
from pdserve.workers.transfer.base import TransferError
from pdserve.workers.transfer.control import (
    CONNECT_BUDGET_S,
    DEFAULT_CREDITS,
    JOIN_S,
    ReceiverControl,
    message_key,
)
from pdserve.workers.transfer.frames import CacheGeometry, KVCaches
from pdserve.workers.transfer.ledger import LedgerReceiver, Notice, ReceiverLedger, refusal
from pdserve.workers.transfer.nccl_channel import (
    TAG_MAX,
    DataChannel,
    Staging,
    first_line,
    gather,
    host_halves,
    pick_backend,
    staging_device,
    wire_bytes,
)
from pdserve.workers.transfer.nccl_store import STORE_MAGIC, LocalStore, StoreClient, StoreTable
from pdserve.workers.transfer.network_sender import NetworkSender
from pdserve.workers.transfer.streams import CopyStream

log = logging.getLogger(__name__)

DEFAULT_GROUP_TIMEOUT_S = 30.0
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20  # a sender splits a layer's blocks into messages of at most this
DEFAULT_MAX_RECEIVE_BYTES = 256 << 20  # a receiver refuses (breaks the pair on) a header claiming more
DEFAULT_MAX_SENDERS = 64
_REPAIR_BACKOFF_MAX_S = 60.0  # the longest wait between two re-pairings that did not form
_PAIR_POLL_S = 0.02  # a pair thread's longest sleep: how soon it notices close or a test's stall switch
_SENDER_JOIN_S = 1.0
_KEY = re.compile(r"[A-Za-z0-9_.-]{1,100}")
_WILDCARD_HOSTS = {"", "*", "0.0.0.0", "::"}
_EMPTY = np.zeros(0, dtype=np.uint8)


# -- addresses and backends ----------------------------------------------------------------


def parse_address(address: str) -> tuple[str, int]:
    """A receiver's address, `tcp://host:port` (its ROUTER's endpoint) -> (host, port)."""
    host, sep, port = address[len("tcp://"):].rpartition(":")
    if not (address.startswith("tcp://") and sep and host and port.isdigit()):
        raise ValueError(f"address: expected 'tcp://host:port', got {address!r}")
    return host.strip("[]"), int(port)


def _local_ip_towards(host: str, port: int) -> str | None:
    """This host's address on the route to `host`: what the peer can reach us at (no packet is sent)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    except OSError:
        return None


# -- receiver ------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Pair:
    """The receiver's side of one sender: its headers in order, its data channel, the thread for both."""

    key: str
    peer: bytes  # ZeroMQ routing id (= key)
    gloo_hostname: str | None
    cond: threading.Condition
    queue: collections.deque[tuple[KVTransferHeader, bool]]  # (header, beyond the credit window)
    in_flight: int = 0
    tag: int = 0
    channel: DataChannel | None = None
    broken: str | None = None
    thread: threading.Thread | None = None
    used_at: float = field(default_factory=time.monotonic)  # its hello or its last header
    evicted: bool = False  # set (under `cond`) when a hello took its place: its thread ends


class NcclKVReceiver(LedgerReceiver):
    """Binds a ROUTER at `bind` (port `*`: any free one; see `address`) and writes into `kv_caches`."""

    def __init__(self, kv_caches: KVCaches, bind: str = "tcp://127.0.0.1:*", *, backend: str | None = None,
                 credits: int = DEFAULT_CREDITS, verify_checksums: bool = False,
                 group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S, max_message_bytes: int = DEFAULT_MAX_RECEIVE_BYTES,
                 max_senders: int = DEFAULT_MAX_SENDERS, gloo_hostname: str | None = None,
                 context: zmq.Context[zmq.Socket[bytes]] | None = None, faults: TransferFaults | None = None,
                 secret: ClusterSecret | None = None, fingerprint: str = "") -> None:
        super().__init__(ReceiverLedger(kv_caches))
        self._backend = pick_backend(self._ledger.geometry, backend)
        self.staging_device = staging_device(self._ledger.geometry, self._backend)
        self._verify = verify_checksums
        self.num_checksummed = 0  # data messages whose bytes this receiver checksummed (on the host)
        self._group_timeout_s = group_timeout_s
        self._max_message_bytes = max_message_bytes
        self._max_senders = max_senders
        self._faults = faults
        self._table = StoreTable()  # the pairs' rendezvous store, served on the ROUTER
        self._pairs: dict[bytes, _Pair] = {}
        self._pairs_lock = threading.Lock()
        # Tensors travel on the data channel: a control message is its header frame alone.
        self._control = ReceiverControl(self._ledger, bind, credits=credits, context=context, max_frames=1,
                                        on_header=self._on_header, on_hello=self._on_hello,
                                        on_request=self._on_store_request, secret=secret, fingerprint=fingerprint,
                                        max_frame_bytes=MAX_MESSAGE_BYTES + SMALL_FRAME_BYTES, verify=verify_checksums)
        self.address = self._control.address
        host = parse_address(self.address)[0]
        self._gloo_hostname = gloo_hostname or (None if host in _WILDCARD_HOSTS else host)
        self._control.start()

    def _close_backend(self) -> None:
        end = time.monotonic() + JOIN_S
        self._control.close()  # sets `stopped`, which the pair threads watch too
        with self._pairs_lock:
            pairs = list(self._pairs.values())
        for pair in pairs:
            with pair.cond:
                pair.cond.notify_all()
        for pair in pairs:
            if pair.thread is not None:
                pair.thread.join(max(0.0, end - time.monotonic()))
        stuck = [p.key for p in pairs if p.thread is not None and p.thread.is_alive()]
        if stuck:  # in a gloo recv or in group formation: ends at the group timeout, then exits
            log.error("KV receiver %s: pair threads %s did not stop within %.1f s", self.address, stuck, JOIN_S)

    @property
    def thread_alive(self) -> bool:
        """Whether the I/O thread or any pair thread still runs."""
        with self._pairs_lock:
            pairs = list(self._pairs.values())
        return self._control.alive or any(p.thread is not None and p.thread.is_alive() for p in pairs)

    @property
    def refusals(self) -> RefusalCounts:
        """What the receiver refused from peers (forged, replayed, another model, dropped connections)."""
        return self._control.refusals

    @property
    def senders(self) -> int:
        """Pairs formed or forming (one per sender that said hello)."""
        with self._pairs_lock:
            return len(self._pairs)

    def _post(self, notice: Notice | None) -> None:
        if notice is not None:
            self._control.post(notice.peer, notice.message)

    # -- I/O thread ------------------------------------------------------------------------

    def _on_store_request(self, peer: bytes, body: list[zmq.Frame]) -> list[bytes]:
        """A sender's rank at its rendezvous (the control plane checked the request's MAC); the reply."""
        if not (len(body) == 5 and body[0].bytes == STORE_MAGIC):
            return [STORE_MAGIC, b"error", b"malformed store request"]
        return [STORE_MAGIC, *self._table.serve(*(f.bytes for f in body[1:]))]

    def _on_hello(self, peer: bytes, hello: KVTransferHello, frame: zmq.Frame) -> str | None:
        key = hello.sender_id
        with self._pairs_lock:
            refused = ("its sender id is not its routing id" if not (_KEY.fullmatch(key) and peer == key.encode())
                       else "a second hello" if peer in self._pairs
                       else None)
            if refused is None and len(self._pairs) >= self._max_senders and not self._evict_one():
                refused = f"already {len(self._pairs)} senders, each with a transfer in flight"
            if refused is None:
                pair = _Pair(key, peer, self._gloo_hostname or self._hostname_towards(frame),
                             threading.Condition(), collections.deque())
                pair.thread = threading.Thread(target=self._pair_main, args=(pair,), daemon=True,
                                               name=f"kv-receiver-pair {key}")
                self._pairs[peer] = pair
        if refused is not None:  # the control plane tells the sender why: its sends fail at once
            log.warning("KV receiver %s: refused a hello from %r: %s", self.address, peer, refused)
            return refused
        assert pair.thread is not None
        pair.thread.start()  # forms the group while the sender forms its side
        return None

    def _evict_one(self) -> bool:
        """Make room for a new pair (`_pairs_lock` held): drop a broken pair, else the longest idle one
        with nothing in flight. False when every pair is busy."""
        def idle(p: _Pair) -> bool:
            return p.in_flight == 0 and not p.queue

        broken = [p for p in self._pairs.values() if p.broken is not None and idle(p)]
        idle_pairs = broken or sorted((p for p in self._pairs.values() if idle(p)), key=lambda p: p.used_at)
        if not idle_pairs:
            return False
        victim = idle_pairs[0]
        with victim.cond:
            if not idle(victim):  # a header came for it meanwhile
                return False
            victim.evicted = True
            victim.cond.notify_all()
        del self._pairs[victim.peer]
        log.info("KV receiver %s: dropped the %s pair of sender %s to pair with a new one", self.address,
                 "broken" if victim.broken is not None else "idle", victim.key)
        return True

    @staticmethod
    def _hostname_towards(frame: zmq.Frame) -> str | None:
        try:
            peer_host = frame.get("Peer-Address")
        except zmq.ZMQError:
            return None
        return _local_ip_towards(str(peer_host), 9) if peer_host else None

    def _on_header(self, peer: bytes, header: KVTransferHeader, tensor_frames: list[zmq.Frame]) -> None:
        with self._pairs_lock:
            pair = self._pairs.get(peer)
        if pair is None:
            # No pair: never made (no hello: a broken peer), or dropped for a new sender's (`_evict_one`).
            # CLOSED, so that a live sender forms a new pair (its tensor went to a group that is gone).
            self._control.reply(peer, refusal(header, FailReason.CLOSED, "no pair with this sender (never formed, "
                                              "or dropped while idle for another sender's)", credits=0))
            return
        with pair.cond:
            pair.used_at = time.monotonic()
            pair.in_flight += 1
            pair.queue.append((header, pair.in_flight > self._control.credits))
            pair.cond.notify()

    # -- pair threads ------------------------------------------------------------------------

    def _pair_main(self, pair: _Pair) -> None:
        with CopyStream(self._ledger.geometry.device):  # recv, then the writes into the cache, off the engine's stream
            self._pair_loop(pair)

    def _pair_loop(self, pair: _Pair) -> None:
        try:
            pair.channel = DataChannel(self._backend, LocalStore(self._table, self._group_timeout_s), pair.key, 0,
                                        self._group_timeout_s, self.staging_device, pair.gloo_hostname)
        except Exception as e:
            pair.broken = f"not formed: {first_line(e)}"
            log.warning("KV receiver %s: data channel of sender %s %s", self.address, pair.key, pair.broken)
        finally:  # formed (the sender has read our keys: it connected) or failed: the keys are done with
            self._table.drop_prefix(f"pdserve-kv/{pair.key}/")
        staging = Staging(self.staging_device)  # one buffer, grown to the largest message
        try:
            while (item := self._next(pair)) is not None:
                ack = self._receive(pair, staging, *item)
                with pair.cond:
                    pair.in_flight -= 1
                self._control.post(pair.peer, ack)
        except Exception as e:
            pair.broken = f"receive loop failed: {first_line(e)}"
            log.exception("KV receiver %s: pair thread of sender %s failed", self.address, pair.key)
        finally:
            if pair.channel is not None:
                pair.channel.close()

    def _next(self, pair: _Pair) -> tuple[KVTransferHeader, bool] | None:
        with pair.cond:
            while not (self._control.stopped.is_set() or pair.evicted):
                if pair.queue and not (self._faults is not None and self._faults.receiver_stalled):
                    return pair.queue.popleft()
                pair.cond.wait(_PAIR_POLL_S)
        return None

    def _receive(self, pair: _Pair, staging: Staging, header: KVTransferHeader, beyond_credit: bool) -> KVTransferAck:
        """Take the tensor of `header` off the data channel, then let the ledger decide. Returns the ack."""
        if header.is_last:
            if beyond_credit:
                return refusal(header, FailReason.PROTOCOL, "sent beyond its credit window", credits=0)
            return self._ledger.apply(header, _EMPTY, _EMPTY, peer=pair.peer)
        payload = None
        if pair.broken is None:
            size = wire_bytes(header)
            if size is None or size > self._max_message_bytes:
                pair.broken = (f"header {header.request_id!r} seq {header.seq} announces a tensor that cannot be "
                               f"received ({size} bytes, limit {self._max_message_bytes})")
            else:
                buf = staging.take(size)
                staging.give(buf)  # used only by this thread, one message at a time
                payload = buf[:size]
                pair.tag = pair.tag % TAG_MAX + 1
                try:
                    assert pair.channel is not None
                    work = pair.channel.recv(payload, pair.tag)
                    pair.channel.wait(work, time.monotonic() + self._group_timeout_s, self._control.stopped)
                except Exception as e:
                    pair.broken = f"recv failed: {first_line(e)}"
            if pair.broken is not None:
                log.warning("KV receiver %s: data channel of sender %s broke: %s", self.address, pair.key, pair.broken)
                if pair.channel is not None:
                    pair.channel.close()
        if pair.broken is not None or payload is None:
            return self._ledger.fail_transfer(header, FailReason.CLOSED,
                                              f"data channel from sender {pair.key} is broken: {pair.broken}")
        if beyond_credit:  # received (the streams stay aligned), then discarded, as the ZeroMQ receiver does
            return refusal(header, FailReason.PROTOCOL, "sent beyond its credit window", credits=0)
        if not self._verify and header.checksum_kind is ChecksumKind.NONE:  # as negotiated at hello
            half = payload.numel() // 2  # the frames stay where they landed (on the GPU for NCCL)
            return self._ledger.apply(header, payload[:half], payload[half:], peer=pair.peer, verify=False)
        self.num_checksummed += 1  # (a header without one, to a receiver that verifies, fails PROTOCOL there)
        return self._ledger.apply(header, *host_halves(payload), peer=pair.peer)


# -- sender --------------------------------------------------------------------------------------


def _new_key(sender_id: str) -> str:
    label = re.sub(r"[^A-Za-z0-9_.-]", "_", sender_id)[:40]
    return f"{label}-{uuid.uuid4().hex}" if label else uuid.uuid4().hex


class NcclKVSender(NetworkSender):
    """Connects to one receiver's `address`, forms the pair's group, and sends blocks of `kv_caches` to it."""

    def __init__(self, kv_caches: KVCaches, address: str, *, backend: str | None = None,
                 checksums: Sequence[ChecksumKind] = frames.CHECKSUMS, verify_checksums: bool = False,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
                 gloo_hostname: str | None = None, sender_id: str = "",
                 context: zmq.Context[zmq.Socket[bytes]] | None = None, faults: TransferFaults | None = None,
                 connect_budget_s: float = CONNECT_BUDGET_S, secret: ClusterSecret | None = None,
                 fingerprint: str = "") -> None:
        host, port = parse_address(address)
        self._backend = pick_backend(CacheGeometry.of(kv_caches), backend)  # before any socket exists
        self._label = sender_id
        self.key = _new_key(sender_id)
        # Without `verify_checksums` this sender offers NONE too: no checksum unless the receiver asks for one.
        offered = tuple(checksums) if verify_checksums else (ChecksumKind.NONE, *checksums)
        super().__init__(kv_caches, address, context=context, faults=faults, sender_id=self.key,
                         checksums=offered, max_message_bytes=max_message_bytes,
                         routing_id=self.key.encode(),  # names the pair; a new one after a lost link
                         connect_budget_s=connect_budget_s, secret=secret, fingerprint=fingerprint)
        self._staging = Staging(staging_device(self._book.geometry, self._backend))
        self.num_checksummed = 0  # data messages whose bytes this sender checksummed (on the host)
        self.num_repairs = 0  # new pairs formed after the data channel broke (`_repair`)
        self._repair_at = 0.0  # no re-pairing before this (monotonic)
        self._repairs_unformed = 0  # re-pairings since a pair last formed
        self._tag = 0
        self._group_timeout_s = group_timeout_s
        self._gloo_hostname = gloo_hostname or _local_ip_towards(host, port)
        self._channel_lock = threading.Lock()
        self._channel: DataChannel | None = None
        self._channel_error: str | None = None
        self._generation = 0  # of the pair: a lost link ends one, its resync forms the next
        self._channel_ready = threading.Event()
        self._former = self._start_forming()

    def wait_ready(self, timeout: float) -> bool:
        """True once the data channel is formed; False if forming it failed or takes longer than `timeout` s."""
        return self._channel_ready.wait(timeout) and self._channel is not None

    def close(self) -> None:
        super().close()
        with self._channel_lock:
            channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        self._staging.clear()  # with the group, the last references: the connection closes now
        self._former.join(_SENDER_JOIN_S)  # formation in progress closes its channel itself when it ends

    # -- group formation (its own thread) ------------------------------------------------------

    def _start_forming(self) -> threading.Thread:
        former = threading.Thread(target=self._form, name=f"kv-sender-form {self.key}", daemon=True,
                                  args=(self._generation, self.key, self._channel_ready))
        former.start()
        return former

    def _form(self, generation: int, key: str, ready: threading.Event) -> None:
        timeout_s = self._group_timeout_s
        store = StoreClient(self.address, self._context, timeout_s, self._secret)
        try:
            channel = DataChannel(self._backend, store, key, 1, timeout_s, self._staging.device, self._gloo_hostname)
        except Exception as e:
            with self._channel_lock:
                if generation == self._generation:
                    self._channel_error = f"not formed: {first_line(e)}"
            log.warning("KV sender -> %s: data channel %s not formed: %s", self.address, key, first_line(e))
        else:
            with self._channel_lock:
                if self._closed or generation != self._generation:  # closed, or its link was lost meanwhile
                    channel.close()
                else:
                    self._channel = channel
                    self._repairs_unformed, self._repair_at = 0, 0.0
        finally:
            store.retire()
            ready.set()

    # -- NetworkSender hooks (lock held) -------------------------------------------------------

    def _send_message(self, request_id: str, layer: int, src: list[int], dst: list[int], deadline: float) -> None:
        if (self._channel_ready.is_set() and self._channel is None and not self._closed
                and time.monotonic() >= self._repair_at):
            self._repair()
        self._await_credit(request_id, deadline)
        self._await_channel(request_id, deadline)
        # Gather only once a credit is in hand: the credit window also bounds the staging memory.
        staging = self._staging.take(frames.frame_bytes(self._book.geometry, len(src)))
        payload = gather(self._book.kv_caches, self._book.geometry, layer, src, staging)
        kind, crc = self._checksum, 0  # as the receiver's grant named it
        if kind is not ChecksumKind.NONE:
            crc = frames.checksum(kind, *host_halves(payload))  # a device-to-host copy on CUDA
            self.num_checksummed += 1
        header = self._book.data_header(request_id, layer, dst, kind, crc)
        work = self._put(header, payload)
        if work is not None:
            self._staging.hold(message_key(header), staging, work)
        else:
            self._staging.give(staging)
        self._book.commit(header)

    def _on_link_lost(self, detail: str) -> None:
        # The pair's two streams may no longer line up (headers lost with the connection, their tensors not):
        # this pair is over. The next connection says hello under a new key, which the receiver pairs anew.
        self._break(f"control link lost: {detail}")
        with self._channel_lock:
            self._generation += 1
            self._channel_error = "not formed yet (the link is being resynchronized)"
        self._channel_ready = threading.Event()
        self._tag = 0  # the next pair counts its messages from the start
        self.key = _new_key(self._label)
        self._routing_id, self._sender_id = self.key.encode(), self.key

    def _repair(self) -> None:
        """The pair broke (or never formed): form a new one, as after a lost link, rather than fail every
        later transfer to this receiver with CLOSED. What was in flight on the old pair fails."""
        self.num_repairs += 1
        # Pairs that keep breaking (a gloo or NCCL peer this host cannot reach) are formed again after
        # 1, 2, 4 ... 60 s, their transfers failing at once meanwhile (as a broken pair's do), not each
        # waiting for a formation that fails again; a pair that forms starts the count over.
        self._repair_at = time.monotonic() + min(_REPAIR_BACKOFF_MAX_S, 2.0 ** self._repairs_unformed)
        self._repairs_unformed += 1
        detail = f"re-pairing with {self.address}: the data channel broke ({self._channel_error})"
        log.warning("KV sender -> %s: %s", self.address, detail)
        self._reconnect(FailReason.CLOSED, detail, "sender re-paired: its data channel broke")

    def _on_resync(self) -> None:
        self._former = self._start_forming()  # the receiver is forming its side now, on our hello

    def _on_ack(self, ack: KVTransferAck) -> None:
        key = (ack.request_id, ack.transfer_id, ack.seq)
        if ack.reason is FailReason.CLOSED:
            # The receiver closed, or its side of our channel broke: the bytes may never have been
            # taken, so the send may never complete. Shut our side, then drop the buffer unwaited.
            if self._channel is not None:
                self._break(f"the receiver reported: {ack.detail}")
            self._staging.forget(key)
        else:
            self._staging.release(key)

    # -- helpers (lock held) ----------------------------------------------------------------

    def _put(self, header: KVTransferHeader, payload: torch.Tensor) -> Any:
        """Put one data message on its way, tensor first (faults applied); the Work of its send, None if dropped."""
        fault = self._take_fault(header)
        if fault is FaultAction.DROP:
            return None  # lost on the way: no credit spent, no ack will come
        if fault is FaultAction.CORRUPT:
            mid = payload.numel() // 4  # in the K frame, after the checksum was taken; staging, not the cache
            payload[mid : mid + 1].bitwise_xor_(0xFF)
        channel = self._channel
        assert channel is not None
        self._tag = self._tag % TAG_MAX + 1
        try:
            work = channel.send(payload, self._tag)
        except Exception as e:
            self._break(f"send failed: {first_line(e)}")
            raise TransferError(header.request_id, FailReason.CLOSED,
                                f"data channel to {self.address} is broken: {self._channel_error}") from None
        try:
            self._put_header(header)
        except TransferError as e:  # a tensor without its header: the two streams no longer line up
            self._break(f"a header could not follow its tensor: {e.detail}")
            raise
        return work

    def _await_channel(self, request_id: str, deadline: float) -> None:
        while not self._channel_ready.is_set():  # in short sleeps: `close` from another thread ends it
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferError(request_id, FailReason.TIMEOUT,
                                    f"data channel to {self.address} not formed by the deadline")
            self._channel_ready.wait(self._sleep_s(request_id, remaining))
        if self._channel is None:
            raise TransferError(request_id, FailReason.CLOSED,
                                f"data channel to {self.address} is broken: {self._channel_error}")

    def _break(self, reason: str) -> None:
        log.warning("KV sender -> %s: data channel broke: %s", self.address, reason)
        with self._channel_lock:
            channel, self._channel = self._channel, None
            self._channel_error = reason
        if channel is not None:
            channel.close()
        self._staging.clear()  # their sends will not complete: never wait on them


__all__ = ["DEFAULT_GROUP_TIMEOUT_S", "NcclKVReceiver", "NcclKVSender", "parse_address"]
