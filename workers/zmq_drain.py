"""Reading a ZeroMQ socket from an asyncio loop's reader callback.

A ZeroMQ socket's FD is edge-triggered: it signals only when the socket goes from
nothing to read to something, and it also signals for writes. So a wake reads until
ZMQ_EVENTS lacks POLLIN, up to a bound per wake (the rest on the loop's next turn: a
flood does not starve the other callbacks), and a message its handler chokes on is
logged, never left to stop the reading (the FD would not wake again).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import cast

import zmq

log = logging.getLogger(__name__)

DRAIN_BOUND = 64  # messages taken per wake before other callbacks run


def readable(sock: zmq.Socket[bytes]) -> bool:
    """Whether `sock` has a whole message to read (ZMQ_EVENTS, not the FD: the FD only wakes)."""
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def drain(loop: asyncio.AbstractEventLoop, sock_of: Callable[[], zmq.Socket[bytes] | None],
          take: Callable[[list[bytes]], None], what: str) -> None:
    """Hand each message queued on `sock_of()` (None: closed, stop) to `take`; call it from
    the loop's reader callback for the socket's FD, and once after adding the reader (to arm
    the edge)."""
    for _ in range(DRAIN_BOUND):
        sock = sock_of()
        if sock is None or not readable(sock):
            return
        try:
            parts = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            take(parts)
        except Exception:  # a bug here must not leave the socket undrained (its FD would not wake again)
            log.exception("%s: a message could not be handled", what)
    loop.call_soon(drain, loop, sock_of, take, what)
