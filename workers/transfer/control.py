"""The ZeroMQ control plane that both network backends share (`zmq_backend`, `nccl_backend`).

Sockets: the receiver (decode worker) binds one ROUTER; each sender (prefill
worker) connects one DEALER to it. Why ROUTER/DEALER and not PUSH/PULL plus a
back channel:
  * one TCP connection per (prefill, decode) pair carries headers one way and
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

Flow control is credit-based, per sender connection. A new sender says hello
(with the checksums it can compute); the receiver grants `credits` messages
(and names the checksum). Each data message or end marker costs one; the
receiver returns it in the message's ack once the message is written or
rejected. A sender out of credit blocks in `send` until its deadline, then
raises TIMEOUT, so a slow decode worker makes prefill workers wait (visibly),
never buffer without bound. Control messages (hello, acks, aborts) need no
credit.

Liveness and resync (`workers/link_monitor.py`). Both ends turn on ZMTP
heartbeats (a PING a second; a connection silent for 3 s after one is closed),
so a receiver that died or hangs (SIGKILL, SIGSTOP, a dead host) loses its
connections within about 4 s, and a receiver drops a dead sender's pipe the same
way. The sender watches its DEALER with a socket monitor, read (like its socket)
whenever it is called: a wait (`send` waiting for credit, `finish` for the
verdict) wakes on link events too. When the connection is lost, every transfer
the receiver had not settled fails at once with PEER_LOST (the one being waited
for raises now, the others at their next call), credits drop to 0, and the
sender opens a new DEALER (a new socket rather than the old one's own reconnect,
so that nothing queued or received on the old connection crosses over: no stale
ack can return a credit of the old window). Its hello goes first, then, once the
receiver's grant gives the new connection its key, an abort for each failed
transfer (a receiver that only hung frees them as soon as it runs again). The
receiver answers a hello with a full window (`_on_hello` starts that peer's
count at zero), which the sender takes as its credit, not added to
what it had: that is a resync (`num_resyncs`; `num_links_lost` counts the
losses). While no connection is up (never made, or lost and not yet back), a
wait lasts at most `connect_budget_s` (5 s) from when the link went down or the
sender was created, then raises PEER_LOST; otherwise deadlines are as above.
Heartbeats see the peer's process and network, not its Python threads: a live
receiver that stops draining still shows as TIMEOUT at the deadline.

Authentication (`auth`; docs/security-data-plane.md). Every message is
`[auth, body...]`: a number and an HMAC-SHA256 tag over a direction label, the
number and every body frame (K and V bytes included). The hello is under a key
derived from the cluster secret and carries the sender's fresh nonce and model
fingerprint; the receiver answers with its own nonce in the grant (or a
`KVHelloRefusal`: another model), and from then on both directions use that
connection's key with rising numbers. The receiver checks the tag before it
decodes anything, and drops (and counts, `refusals`) a message that does not
check or repeats a number; so does the sender. Both bound what a peer can make
them hold: ZMQ_MAXMSGSIZE and high-water marks on every socket.

Threads: the receiver runs one I/O thread (`ReceiverControl`) that owns its
sockets. API calls work on the shared ledger under its lock and hand messages
for peers (aborts) to the I/O thread through a queue and an inproc wake-up
socket. The sender (`NetworkSender`) has no thread: it reads acks and credits
whenever it is called, and its calls are serialized by a lock.

What a backend adds: how a data message's bytes travel (as ZeroMQ frames
after the header, or on a separate data channel), and what its receiver does
with a header and a hello.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Sequence

import zmq

from pdserve.workers.link_monitor import apply_heartbeats, apply_limits
from pdserve.workers.messages import (
    KVCreditGrant,
    KVHelloRefusal,
    KVTransferAbort,
    KVTransferHeader,
    KVTransferHello,
    Message,
    decode,
    decode_as,
    encode,
)
from pdserve.workers.thread_names import name_os_thread
from pdserve.workers.transfer import auth, frames
from pdserve.workers.transfer.auth import ClusterSecret, RefusalCounts, SeqWindow
from pdserve.workers.transfer.ledger import ReceiverLedger

log = logging.getLogger(__name__)

DEFAULT_CREDITS = 8
LINGER_MS = 200  # on close, how long queued aborts may take to leave
JOIN_S = 2.0  # how long close() waits for the I/O thread
CONNECT_BUDGET_S = 5.0  # how long a sender's wait may last while no connection to its receiver is up
_IDLE_POLL_MS = 50  # the I/O thread's longest sleep: how soon it notices a test's stall switch
_BATCH = 64  # messages handled per loop turn before the outbox gets a look
# Peers a receiver keeps a connection key for; past it the least recently heard from is forgotten (its
# next message is refused, as a stranger's). A connection's key is kept first as half open, from its
# hello, and confirmed by its first message sealed under it, which only the hello's maker can seal: a
# hello is sealed under a key every holder of the secret shares, so one recorded off the wire checks
# again from any connection. Replayed hellos only push out each other and half-open keys, never a
# confirmed sender's (1,024 replays had evicted a live prefill worker's key, and its transfers failed).
MAX_SESSIONS = 1024
MAX_HALF_OPEN = 1024
DEFAULT_MAX_FRAME_BYTES = 64 << 20  # a receiver's ZMQ_MAXMSGSIZE: K or V of one data message, at most
_RECEIVER_HWM = 1000  # messages queued per connection; a sender keeps within its credits (+ a few aborts)
_NO_AUTH = bytes(auth.AUTH_FRAME_BYTES)  # the auth frame of an unauthenticated notice

# A receiver backend's answers to what arrives (all called on the I/O thread):
OnHeader = Callable[[bytes, KVTransferHeader, list[zmq.Frame]], None]  # (peer, header, the frames after it)
# (peer, hello, its frame) -> why the sender is refused (it is told), None to grant it credits
OnHello = Callable[[bytes, KVTransferHello, zmq.Frame], str | None]
# (peer, the frames of a store request whose MAC checked) -> its reply's frames (the NCCL rendezvous store)
OnRequest = Callable[[bytes, list[zmq.Frame]], list[bytes]]


class _Session:
    """A receiver's key and numbers for one sender connection (I/O thread only)."""

    __slots__ = ("key", "rx", "tx")

    def __init__(self, key: bytes) -> None:
        self.key, self.rx, self.tx = key, SeqWindow(), 0


class ReceiverControl:
    """A receiver's ROUTER at `bind` (port `*`: any free one; see `address`) and the I/O thread that owns it.

    The thread checks each message's MAC (`auth`: a hello's under a key derived from the cluster
    secret, anything else under its connection's key, numbers rising), decodes it and passes it on: a
    header to `on_header`, a hello to `on_hello` (which grants the sender `credits`, or says why not),
    an abort to the ledger. A message whose MAC does not check is dropped and counted (`refusals`); so
    is a hello from a sender whose model `fingerprint` is not ours. A refused hello (another model, or
    `on_hello`'s reason) gets a `KVHelloRefusal` that says why, so the sender fails at once.
    `on_request` answers the NCCL rendezvous store's requests (their own key); `on_turn` runs once per
    loop turn. `max_frames` bounds a message's frames (header included), `max_frame_bytes` each frame's
    size (ZMQ_MAXMSGSIZE: a bigger one drops its connection). `verify`: whether this receiver asks for
    a checksum even of a sender that offers none (the grant names the checksum both ends then use).
    Other threads never touch the ROUTER: they `post` messages, which the I/O thread sends. `start`
    once the owner is ready.
    """

    def __init__(self, ledger: ReceiverLedger, bind: str, *, credits: int,
                 context: zmq.Context[zmq.Socket[bytes]] | None, on_header: OnHeader, on_hello: OnHello,
                 on_request: OnRequest | None = None, on_turn: Callable[[], None] | None = None,
                 max_frames: int | None = None, secret: ClusterSecret | None = None, fingerprint: str = "",
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, verify: bool = True) -> None:
        if credits < 1:
            raise ValueError(f"credits: must be >= 1, got {credits}")
        self.credits = credits
        self.verify = verify  # False: grant NONE to a sender that offers it (`frames.pick_checksum`)
        self._ledger = ledger
        self._on_header, self._on_hello, self._on_request, self._on_turn = on_header, on_hello, on_request, on_turn
        self._max_frames = max_frames
        self._secret = auth.resolve(secret)
        self._hello_key = self._secret.derive(auth.KV_HELLO)
        self._store_key = self._secret.derive(auth.STORE_REQUEST)
        self.fingerprint = fingerprint
        self._sessions: collections.OrderedDict[bytes, _Session] = collections.OrderedDict()
        self._half_open: collections.OrderedDict[bytes, _Session] = collections.OrderedDict()
        self._store_windows: collections.OrderedDict[bytes, SeqWindow] = collections.OrderedDict()
        self.refusals = RefusalCounts()
        ctx = context or zmq.Context.instance()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, LINGER_MS)
        apply_heartbeats(self._sock)  # a dead or frozen sender's connection is dropped, not kept forever
        apply_limits(self._sock, max_frame_bytes=max_frame_bytes, rcvhwm=_RECEIVER_HWM, sndhwm=_RECEIVER_HWM)
        # Counts the connections the ROUTER loses (an oversize frame drops one; so does a peer leaving).
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.bind(bind)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        wake = f"inproc://pdserve-kv-wake-{uuid.uuid4().hex}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.connect(wake)
        self._wake_lock = threading.Lock()  # the one socket other threads touch
        self._outbox: collections.deque[tuple[bytes, Message]] = collections.deque()
        self.stopped = threading.Event()  # set by close(), or when the I/O thread fails
        self._thread = threading.Thread(target=self._run, name=f"kv-receiver {self.address}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def post(self, peer: bytes, message: Message) -> None:
        """Queue `message` for `peer`; the I/O thread sends it. Any thread; never blocks."""
        self._outbox.append((peer, message))
        self._wake()

    def reply(self, peer: bytes, message: Message) -> None:
        """Send `message` to `peer` now, under its connection's key. I/O thread only; a vanished or
        stalled peer (or one we hold no key for) is logged, not waited for."""
        session = self._sessions.get(peer) or self._half_open.get(peer)
        if session is None:
            log.info("KV receiver %s: no connection key for %r; %s not sent", self.address, peer,
                     type(message).__name__)
            return
        session.tx += 1
        body = encode(message)
        self._send(peer, [auth.seal(session.key, auth.KV_TO_SENDER, session.tx, [body]), body])

    def _send(self, peer: bytes, parts: Sequence[bytes]) -> None:
        try:
            self._sock.send_multipart([peer, *parts], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the sender is gone; EAGAIN: it stopped reading
            log.info("KV receiver %s: could not reply to %r: %s", self.address, peer, e)

    def close(self) -> None:
        """Stop the I/O thread (it sends what was posted first) within `JOIN_S`, and free the sockets.

        A thread that does not stop in time is logged and left with its sockets (daemon).
        """
        self.stopped.set()
        self._wake()
        self._thread.join(JOIN_S)
        if self._thread.is_alive():
            log.error("KV receiver %s: I/O thread did not stop within %.1f s", self.address, JOIN_S)
            return
        with self._wake_lock:
            self._wake_tx.close(linger=0)

    # -- I/O thread --------------------------------------------------------------------

    def _run(self) -> None:
        name_os_thread("pd-kv-recv")
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self.stopped.is_set():
                events = dict(poller.poll(_IDLE_POLL_MS))
                if self._wake_rx in events:
                    _drain_wakeups(self._wake_rx)
                if self._monitor in events:
                    self.refusals.dropped += _count_events(self._monitor)
                self._flush_outbox()
                if self._on_turn is not None:
                    self._on_turn()
                if self._sock in events:
                    self._handle_socket()
            self._flush_outbox()  # the close() aborts
        except Exception:
            log.exception("KV receiver %s: I/O thread failed; failing pending transfers", self.address)
            self._ledger.close()
            self.stopped.set()
        finally:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close()
            self._wake_rx.close(linger=0)

    def _handle_socket(self) -> None:
        for _ in range(_BATCH):
            try:
                parts = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(parts)

    def _handle(self, parts: list[zmq.Frame]) -> None:
        """One message from `peer`: [auth, body...]. Nothing is decoded before its MAC checked."""
        peer = parts[0].bytes
        if len(parts) < 3:
            return self._refuse(peer, "no auth frame")
        tag, body = parts[1].buffer, parts[2:]
        buffers = [f.buffer for f in body]
        session = self._sessions.get(peer)
        confirmed = session is not None
        if session is None:
            session = self._half_open.get(peer)
        if session is not None and (seq := auth.check(session.key, auth.KV_TO_RECEIVER, tag, buffers)) is not None:
            if not session.rx.fresh(seq):
                self.refusals.replayed += 1
                log.warning("KV receiver %s: refused a replayed message (#%d) from %r", self.address, seq, peer)
                return None
            session.rx.take(seq)
            if not confirmed:  # its first message under the hello's key: the hello was its maker's
                del self._half_open[peer]
                self._sessions[peer] = session
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
            self._sessions.move_to_end(peer)
            return self._dispatch(peer, body)
        if auth.check(self._hello_key, auth.KV_HELLO, tag, buffers) is not None:
            return self._hello(peer, body)
        if self._on_request is not None and (seq := auth.check(self._store_key, auth.STORE_REQUEST, tag,
                                                                 buffers)) is not None:
            window = self._store_windows.setdefault(peer, SeqWindow())
            self._store_windows.move_to_end(peer)
            while len(self._store_windows) > MAX_SESSIONS:
                self._store_windows.popitem(last=False)
            if not window.fresh(seq):
                self.refusals.replayed += 1
                return None
            window.take(seq)
            reply = self._on_request(peer, body)
            # Bound to the request (its tag): a reply recorded for one request does not answer another.
            self._send(peer, [auth.seal(self._store_key, auth.STORE_REPLY, seq, [tag, *reply]), *reply])
            return None
        return self._refuse(peer, "its MAC does not check", body)

    def _refuse(self, peer: bytes, why: str, body: Sequence[zmq.Frame] = ()) -> None:
        """A message that is not from a holder of the cluster secret (or was altered): dropped, counted.
        A hello gets an unauthenticated refusal, so that a sender with another secret learns why."""
        self.refusals.forged += 1
        if self.refusals.forged & (self.refusals.forged - 1) == 0:  # 1, 2, 4, ...: a flood does not flood the log
            log.warning("KV receiver %s: refused a message from %r: %s (%d refused so far)", self.address, peer, why,
                        self.refusals.forged)
        if len(body) == 1:
            try:
                hello = decode_as(body[0].buffer, KVTransferHello)
            except ValueError:
                return
            notice = KVHelloRefusal(nonce=hello.nonce, receiver_nonce="",
                                    reason="its MAC does not check: the two workers have different cluster secrets")
            self._send(peer, [_NO_AUTH, encode(notice)])

    def _hello(self, peer: bytes, body: list[zmq.Frame]) -> None:
        try:
            if len(body) != 1:
                raise ValueError(f"{len(body)} frames")
            hello = decode_as(body[0].buffer, KVTransferHello)
        except ValueError as e:
            log.warning("KV receiver %s: dropped a bad hello from %r: %s", self.address, peer, e)
            return
        nonce = auth.new_nonce()
        key = auth.session_key(self._secret, hello.nonce, nonce)
        if self.fingerprint and hello.fingerprint and hello.fingerprint != self.fingerprint:
            self.refusals.wrong_model += 1
            reason = (f"the sender runs another model (fingerprint {hello.fingerprint}, this decode worker's is "
                      f"{self.fingerprint}): prefill and decode workers must load the same model")
            log.error("KV receiver %s: refused sender %r: %s", self.address, hello.sender_id, reason)
            return self._refuse_hello(peer, hello.nonce, nonce, key, reason)
        refused = self._on_hello(peer, hello, body[0])
        if refused is not None:
            return self._refuse_hello(peer, hello.nonce, nonce, key, refused)
        self._sessions.pop(peer, None)  # a new hello on a connection starts it again
        self._half_open[peer] = _Session(key)
        self._half_open.move_to_end(peer)
        while len(self._half_open) > MAX_HALF_OPEN:
            self._half_open.popitem(last=False)
        checksum = frames.pick_checksum(hello.checksums, self.verify)
        self.reply(peer, KVCreditGrant(credits=self.credits, checksum=checksum, nonce=nonce))

    def _refuse_hello(self, peer: bytes, sender_nonce: str, nonce: str, key: bytes, reason: str) -> None:
        """Tell a sender why its hello is refused, under the key the hello made: its sends then fail at once
        with PROTOCOL and `reason`. Unanswered, they waited out their deadlines (30 s each) for a credit that
        never came, and said the receiver was not draining."""
        notice = encode(KVHelloRefusal(nonce=sender_nonce, receiver_nonce=nonce, reason=reason))
        self._send(peer, [auth.seal(key, auth.KV_TO_SENDER, 1, [notice]), notice])

    def _dispatch(self, peer: bytes, body: list[zmq.Frame]) -> None:
        """A message whose MAC and number checked, from a sender that said hello on this connection."""
        try:
            if self._max_frames is not None and len(body) > self._max_frames:
                raise ValueError(f"{len(body)} frames, at most {self._max_frames} expected")
            msg = decode(body[0].buffer)
        except ValueError as e:
            # Not even a header: nothing to ack, and no credit is returned to a peer this broken.
            log.warning("KV receiver %s: dropped a bad message from %r: %s", self.address, peer, e)
            return
        if isinstance(msg, KVTransferHeader):
            self._on_header(peer, msg, body[1:])
        elif isinstance(msg, KVTransferAbort):
            self._ledger.on_abort(msg, peer)
        else:
            log.warning("KV receiver %s: unexpected %s from %r", self.address, type(msg).__name__, peer)

    def _flush_outbox(self) -> None:
        while self._outbox:
            self.reply(*self._outbox.popleft())

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_tx.closed:
                return
            try:
                self._wake_tx.send(b"", flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # wake-ups are already queued; one is enough


def message_key(header: KVTransferHeader) -> tuple[str, int, int]:
    """What an ack names its message by."""
    return header.request_id, header.transfer_id, header.seq


def _count_events(monitor: zmq.Socket[bytes]) -> int:
    n = 0
    while True:
        try:
            monitor.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return n
        n += 1


def _drain_wakeups(sock: zmq.Socket[bytes]) -> None:
    while True:
        try:
            sock.recv(flags=zmq.NOBLOCK)
        except zmq.Again:
            return
