"""Would a ZeroMQ PULL endpoint read on the gateway's own loop (ZMTP 3.1 parsed by an asyncio
protocol, no libzmq I/O thread) make the token stream's receive cheaper? A libzmq PUSH socket
in a child process sends one [32-byte tag, 600-byte body] message every `--step-ms`; here
either a libzmq PULL socket drained on its FD (workers/zmq_drain.py, what the gateway's
collector does) or the prototype below takes them, alternating; the figure is this process's
CPU (every thread's) per message.

Measured (docs/front-door.md, "Tried and not kept"): ~17 us a message saved at one message
every 5 ms, ~1 us a token at 16 streams: not worth a hand-kept protocol implementation.

    python bench/experiments/zmtp_reader.py [--step-ms 5] [--messages 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import resource
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import uvloop
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for machine.py
from machine import cpu_name  # noqa: E402

from pdserve.workers.link_monitor import apply_heartbeats  # noqa: E402
from pdserve.workers.zmq_drain import drain  # noqa: E402

log = logging.getLogger(__name__)
_SIGNATURE_LEN = 10
_GREETING_LEN = 64
# 0xFF, 8 bytes of padding (libzmq's: a ZMTP 1.0 length of 1), 0x7F; version 3.1; NULL; not a server.
_GREETING = (b"\xff" + (1).to_bytes(8, "big") + b"\x7f" + bytes([3, 1]) + b"NULL".ljust(20, b"\0") + b"\0"
             + bytes(31))
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
_PEER_TYPES = (b"PUSH",)  # the socket types a PULL socket talks to


def _command(name: bytes, body: bytes) -> bytes:
    data = bytes([len(name)]) + name + body
    return bytes([_COMMAND, len(data)]) + data if len(data) < 256 else \
        bytes([_COMMAND | _LONG]) + len(data).to_bytes(8, "big") + data


_READY = _command(b"READY", bytes([11]) + b"Socket-Type" + struct.pack(">I", 4) + b"PULL")


class ZmtpError(ValueError):
    """What a peer sent is not ZMTP 3 from a PUSH socket, or passes a limit."""


def _properties(data: bytes) -> dict[bytes, bytes]:
    """A READY command's metadata (name: 1-byte length; value: 4-byte length)."""
    props: dict[bytes, bytes] = {}
    i = 0
    while i < len(data):
        n = data[i]
        name = data[i + 1 : i + 1 + n]
        if len(name) != n or i + 1 + n + 4 > len(data):
            raise ZmtpError("READY: a truncated property")
        (m,) = struct.unpack_from(">I", data, i + 1 + n)
        start = i + 1 + n + 4
        if start + m > len(data):
            raise ZmtpError("READY: a truncated property value")
        props[name.lower()] = data[start : start + m]
        i = start + m
    return props


class _Peer(asyncio.Protocol):
    """One worker's connection: greeting, READY, then messages (module docstring)."""

    def __init__(self, endpoint: ZmtpPullEndpoint) -> None:
        self._endpoint = endpoint
        self._buf = bytearray()
        self._ready = False  # the peer's greeting and READY came
        self._parts: list[bytes] = []
        self._transport: asyncio.Transport | None = None
        self._ttl: asyncio.TimerHandle | None = None
        self._heard = False  # anything came since the TTL timer was set

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass of asyncio's)
        self._endpoint._peers.add(self)
        self._transport.write(_GREETING + _READY)

    def connection_lost(self, exc: Exception | None) -> None:
        self._endpoint._peers.discard(self)
        self._endpoint.num_dropped += 1
        if self._ttl is not None:
            self._ttl.cancel()
        self._transport = None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        self._heard = True
        self._buf += data
        try:
            used = self._parse()
        except ZmtpError as e:
            log.warning("token stream: dropped a connection: %s", e)
            self._buf.clear()
            self.close()
            return
        if used:
            del self._buf[:used]

    def _parse(self) -> int:
        """Take every whole frame in the buffer; returns the bytes used."""
        buf = self._buf
        pos = 0
        if not self._ready:
            if len(buf) >= _SIGNATURE_LEN and (buf[0] != 0xFF or not buf[9] & 0x01):
                raise ZmtpError("not a ZMTP greeting")
            if len(buf) > _SIGNATURE_LEN and buf[10] < 3:
                raise ZmtpError(f"ZMTP {buf[10]}.x (3.0 or later needed)")
            if len(buf) < _GREETING_LEN:
                return 0
            if bytes(buf[12:32]).rstrip(b"\0") != b"NULL":
                raise ZmtpError("a security mechanism other than NULL")
            pos = _GREETING_LEN
        limit = self._endpoint.max_frame_bytes
        end = len(buf)
        while pos + 2 <= end:
            flags = buf[pos]
            if flags & ~(_MORE | _LONG | _COMMAND):
                raise ZmtpError(f"reserved frame flags {flags:#x}")
            if flags & _LONG:
                if pos + 9 > end:
                    break
                size = int.from_bytes(buf[pos + 1 : pos + 9], "big")
                start = pos + 9
            else:
                size = buf[pos + 1]
                start = pos + 2
            if size > limit:
                raise ZmtpError(f"a frame of {size} bytes (at most {limit})")
            if start + size > end:
                break
            body = bytes(buf[start : start + size])
            pos = start + size
            if flags & _COMMAND:
                self._on_command(flags, body)
            elif not self._ready:
                raise ZmtpError("a message before READY")
            else:
                self._parts.append(body)
                if flags & _MORE:
                    if len(self._parts) >= self._endpoint.max_parts:
                        raise ZmtpError(f"a message of more than {self._endpoint.max_parts} frames")
                    continue
                parts, self._parts = self._parts, []
                try:
                    self._endpoint._on_message(parts)
                except Exception:  # the handler's bug must not stop the reading
                    log.exception("token stream: a message could not be handled")
        return pos

    def _on_command(self, flags: int, body: bytes) -> None:
        if flags & _MORE or not body or len(body) < 1 + body[0]:
            raise ZmtpError("a malformed command")
        name, data = body[1 : 1 + body[0]], body[1 + body[0] :]
        if name == b"READY":
            if self._ready:
                raise ZmtpError("READY twice")
            kind = _properties(data).get(b"socket-type")
            if kind not in _PEER_TYPES:
                raise ZmtpError(f"a {kind!r} socket (a PULL socket takes PUSH)")
            self._ready = True
        elif not self._ready:
            raise ZmtpError(f"{name!r} before READY")
        elif name == b"PING":
            if len(data) < 2:
                raise ZmtpError("a PING without a TTL")
            assert self._transport is not None
            self._transport.write(_command(b"PONG", data[2:18]))
            self._arm_ttl(int.from_bytes(data[:2], "big") / 10)
        elif name == b"ERROR":
            raise ZmtpError(f"the peer reported an error: {data[1 : 1 + data[0]]!r}" if data else "ERROR")
        # Other commands (SUBSCRIBE, ...) mean nothing to a PULL socket: ignored, as libzmq does.

    def _arm_ttl(self, ttl_s: float) -> None:
        """Close the link if nothing comes within `ttl_s` (the peer's PING asked for it)."""
        if self._ttl is not None:
            self._ttl.cancel()
            self._ttl = None
        if ttl_s > 0:
            self._heard = False
            self._ttl = asyncio.get_running_loop().call_later(ttl_s, self._ttl_passed)

    def _ttl_passed(self) -> None:
        self._ttl = None
        if not self._heard:
            log.warning("token stream: a worker's link went silent past its heartbeat TTL; closed")
            self.close()


class ZmtpPullEndpoint:
    """Binds `host` on a free port now and hands every whole message (its frames) to
    `on_message`, on the running loop. `address` is the tcp:// endpoint libzmq PUSH
    sockets connect to. Create it on the loop it serves; `close()` there."""

    def __init__(self, host: str, on_message: Callable[[list[bytes]], None], *, max_frame_bytes: int,
                 max_parts: int = 2) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_message = on_message
        self.max_frame_bytes = max_frame_bytes
        self.max_parts = max_parts
        self.num_dropped = 0  # connections lost (a peer leaving, or one dropped for what it sent)
        self._peers: set[_Peer] = set()
        listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                        backlog=128)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        self.address = f"tcp://{host}:{port}"
        # Connections wait in the listen backlog until the server is up (the loop's next turns).
        self._server: asyncio.AbstractServer | None = None
        self._starting = self._loop.create_task(self._loop.create_server(lambda: _Peer(self), sock=listener))
        self._starting.add_done_callback(self._started)
        self._listener = listener

    def _started(self, task: asyncio.Task[asyncio.AbstractServer]) -> None:
        if task.cancelled():
            self._listener.close()
            return
        if task.exception() is not None:
            log.error("token stream: could not listen on %s: %s", self.address, task.exception())
            self._listener.close()
            return
        self._server = task.result()

    def close(self) -> None:
        """Stop listening and drop every connection."""
        self._starting.cancel()
        if self._server is not None:
            self._server.close()
        else:
            self._listener.close()
        for peer in list(self._peers):
            peer.close()


def _send(address: str, n: int, step_s: float) -> None:
    sock = zmq.Context().socket(zmq.PUSH)
    apply_heartbeats(sock)
    sock.connect(address)
    time.sleep(0.3)
    body = b"y" * 600
    for _ in range(n):
        sock.send_multipart([b"t" * 32, body])
        time.sleep(step_s)
    time.sleep(0.3)
    sock.close(0)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _run(kind: str, n: int, step_s: float) -> float:
    """CPU us per message taken by `kind` ("libzmq" or "zmtp")."""
    got = 0
    done = asyncio.Event()

    def take(parts: list[bytes]) -> None:
        nonlocal got
        got += 1
        if got == n:
            done.set()

    loop = asyncio.get_running_loop()
    if kind == "zmtp":
        endpoint = ZmtpPullEndpoint("127.0.0.1", take, max_frame_bytes=1 << 20)
        address = endpoint.address
    else:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        apply_heartbeats(sock)
        address = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
        loop.add_reader(sock.fileno(), drain, loop, lambda: sock, take, "bench")
        loop.call_soon(drain, loop, lambda: sock, take, "bench")
    sender = mp.get_context("spawn").Process(target=_send, args=(address, n, step_s))
    sender.start()
    async with asyncio.timeout(60 + n * step_s * 2):
        while got == 0:  # from the first message: the sender's start is not measured
            await asyncio.sleep(0.001)
        c0 = _cpu_s()
        await done.wait()
    used = _cpu_s() - c0
    sender.join()
    if kind == "zmtp":
        endpoint.close()
    else:
        loop.remove_reader(sock.fileno())
        sock.close(0)
    return used / (n - 1) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--messages", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    print(f"machine: {cpu_name()}; one message every {a.step_ms:g} ms, {a.messages} a run", flush=True)
    results: dict[str, list[float]] = {"libzmq": [], "zmtp": []}
    for r in range(a.rounds):
        for kind in results:
            results[kind].append(uvloop.run(_run(kind, a.messages, a.step_ms / 1000)))
            print(f"[round {r + 1}] {kind}: {results[kind][-1]:.1f} us of CPU a message", file=sys.stderr, flush=True)
    print("\n| reader | us of CPU a message (runs) | median |\n|---|---|---:|")
    for kind, xs in results.items():
        print(f"| {kind} | {', '.join(f'{x:.1f}' for x in xs)} | {sorted(xs)[len(xs) // 2]:.1f} |")


if __name__ == "__main__":
    main()
