"""Liveness of ZeroMQ links: heartbeats on the socket, and what its socket monitor reports.

A TCP connection to a peer that died (SIGKILL, a crashed host) or hangs (SIGSTOP, a
wedged process) can look open for a long time, and a socket waiting on that peer
waits until whatever deadline its caller gave it. Two pieces fix that:

* `apply_heartbeats(sock)`: ZMTP heartbeats (libzmq >= 4.2). The socket's I/O
  thread sends a PING every `HEARTBEAT_IVL_MS`; a connection on which nothing
  arrives within `HEARTBEAT_TIMEOUT_MS` of a PING is closed, and the TTL sent in
  each PING tells the peer to close its side after `HEARTBEAT_TTL_MS` of silence
  from us. PINGs are answered by libzmq's own I/O thread, not by the application,
  so a busy (GIL-bound, mid-GC) but live process keeps its links; a stopped or
  dead one loses them within `HEARTBEAT_IVL_MS + HEARTBEAT_TIMEOUT_MS` (4 s).
  Both ends should set them: each then notices the other's death.
* `LinkMonitor(sock)`: a socket monitor (`zmq_socket_monitor`) read without a
  thread. `poll()` returns the events that arrived since the last call and keeps
  `connected` up to date: an endpoint counts as up from its
  EVENT_HANDSHAKE_SUCCEEDED (a ZMTP peer answered, not merely a TCP accept) until
  its EVENT_DISCONNECTED, EVENT_CLOSED or a failed handshake. An event that takes
  an up endpoint down is marked `lost`: a heartbeat timeout shows as one too,
  since libzmq closes the connection. Register `monitor.socket` in a
  `zmq.Poller` next to the watched socket to wake on those events while waiting.

Settings (why these): one PING a second costs nothing on a link that carries
megabytes, and any traffic (data, acks) also counts as a sign of life, so a link
busy with a large message is never timed out for want of a PONG. A 3 s timeout
is three intervals: a heavily loaded host or a congested network still answers
within it, and a dead or frozen peer is known within 4 s instead of at a request
deadline of tens of seconds. The TTL equals the timeout, so both ends reach the
same verdict in about the same time.

Meant for connecting sockets (DEALER, PUSH, ...), which have at most one
connection per endpoint. On a binding socket several peers share one endpoint
string, so `connected` is only a rough summary there (`apply_heartbeats` is as
useful on either).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

HEARTBEAT_IVL_MS = 1000  # a PING every second on an otherwise idle connection
HEARTBEAT_TIMEOUT_MS = 3000  # no traffic this long after a PING: the connection is closed
HEARTBEAT_TTL_MS = 3000  # sent in our PINGs: the peer closes its side after this much silence from us
HEARTBEAT_MIN_ZMQ = (4, 2)  # ZMQ_HEARTBEAT_* came with libzmq 4.2

# An endpoint is up from the first until one of the second.
_UP_EVENTS = frozenset({zmq.EVENT_HANDSHAKE_SUCCEEDED})
_DOWN_EVENTS = frozenset({
    zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
})


def heartbeats_supported() -> bool:
    return zmq.zmq_version_info()[:2] >= HEARTBEAT_MIN_ZMQ


def apply_heartbeats(sock: zmq.Socket[bytes] | zmq.asyncio.Socket, *, ivl_ms: int = HEARTBEAT_IVL_MS,
                     timeout_ms: int = HEARTBEAT_TIMEOUT_MS, ttl_ms: int = HEARTBEAT_TTL_MS) -> bool:
    """Turn on ZMTP heartbeats for `sock`'s future connections (set before `connect`/`bind`).

    Returns False (and logs once per call) where libzmq is older than 4.2 and has no heartbeats:
    the link then works as before, and only its death goes unnoticed until a deadline.
    """
    if not heartbeats_supported():
        log.warning("libzmq %s has no heartbeats (needs >= 4.2): dead peers are noticed only at deadlines",
                    zmq.zmq_version())
        return False
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, ttl_ms)
    return True


# Inbound frames on a socket that only ever receives small replies or handshakes
# (a PUSH, a DEALER reading acks): anything bigger is garbage or an attack.
SMALL_FRAME_BYTES = 1 << 20


def apply_limits(sock: zmq.Socket[bytes] | zmq.asyncio.Socket, *, max_frame_bytes: int, rcvhwm: int = 1000,
                 sndhwm: int = 1000) -> None:
    """Bound what a peer can make `sock` hold (set before `connect`/`bind`).

    `ZMQ_MAXMSGSIZE` (`max_frame_bytes`): libzmq checks each incoming frame's size
    from its length prefix and drops the connection before allocating for a bigger
    one, so a peer cannot make us allocate 2 GB by announcing it. The high-water
    marks bound the messages queued per connection each way (0 would be unbounded).
    """
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.SNDHWM, sndhwm)


def event_name(event: int) -> str:
    try:
        name = zmq.Event(event).name
    except ValueError:
        name = None
    return name or f"EVENT_{event:#x}"


@dataclass(frozen=True)
class LinkEvent:
    """One socket-monitor event: `event` is a `zmq.EVENT_*` value, `value` its number (an fd, an errno,
    a reconnect interval, by event), `endpoint` the address it concerns.

    `up`: this event brought `endpoint` up; `lost`: it took an up endpoint down."""

    event: int
    value: int
    endpoint: str
    up: bool = False
    lost: bool = False

    @property
    def name(self) -> str:
        return event_name(self.event)

    def __str__(self) -> str:
        return f"{self.name}({self.endpoint}, {self.value})"


class LinkMonitor:
    """The connection state of one socket, read from its socket monitor whenever `poll()` is called.

    Create it before the socket connects (earlier events are not reported); it has no thread.
    Owned by whoever owns the socket, and used from that socket's thread only (or under its lock).
    `close()` before closing the watched socket.

    Attributes after each `poll()`:
      connected       some endpoint is up (handshake done, not yet disconnected)
      ever_connected  some endpoint was up at some point
      changed_at      `clock()` when `connected` last changed (construction time at first)
      num_ups, num_lost  how many times an endpoint came up / an up endpoint was lost
    """

    def __init__(self, sock: zmq.Socket[bytes], *, events: int = zmq.EVENT_ALL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._watched = sock
        self._clock = clock
        self.socket: zmq.Socket[bytes] = sock.get_monitor_socket(events)  # an inproc PAIR: poll it for wake-ups
        self._up: set[str] = set()
        self.connected = False
        self.ever_connected = False
        self.changed_at = clock()
        self.num_ups = 0
        self.num_lost = 0
        self.closed = False

    def poll(self) -> list[LinkEvent]:
        """Every event that arrived since the last call, oldest first; updates the state. Never blocks."""
        seen: list[LinkEvent] = []
        while not self.closed:
            try:
                parts = self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(parts) != 2 or len(parts[0]) != 6:
                log.warning("socket monitor: unexpected message %r", parts[:2])
                continue
            event, value = struct.unpack("=HI", parts[0])
            seen.append(self._apply(event, value, parts[1].decode("utf-8", "replace")))
        return seen

    def close(self) -> None:
        """Stop monitoring and close the monitor socket (the watched socket stays open). Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self._watched.disable_monitor()
        except zmq.ZMQError:  # the watched socket is already closed
            pass
        self.socket.close(linger=0)

    def _apply(self, event: int, value: int, endpoint: str) -> LinkEvent:
        up = lost = False
        if event in _UP_EVENTS and endpoint not in self._up:
            self._up.add(endpoint)
            up = True
            self.num_ups += 1
            self.ever_connected = True
        elif event in _DOWN_EVENTS and endpoint in self._up:
            self._up.discard(endpoint)
            lost = True
            self.num_lost += 1
        connected = bool(self._up)
        if connected != self.connected:
            self.connected = connected
            self.changed_at = self._clock()
        return LinkEvent(event, value, endpoint, up=up, lost=lost)


__all__ = ["HEARTBEAT_IVL_MS", "HEARTBEAT_TIMEOUT_MS", "HEARTBEAT_TTL_MS", "SMALL_FRAME_BYTES", "LinkEvent",
           "LinkMonitor", "apply_heartbeats", "apply_limits", "event_name", "heartbeats_supported"]
