"""A worker's inbox: where gateways start and abort its requests without a Ray call each.

    gateway (cluster/worker_channel.py)               worker (this module)
    StartTry / AbortTry   --PUSH, signed-->           PULL socket -> a task per try
    tokens, the final one included  <--token stream-- (workers/token_stream.py)
    outcomes(gateway)     --one Ray call, long-poll-> the tries that failed here, and
                                                      the worker's death (the call fails)

A try's success is its final delta on the token stream; what is left for the control
plane is a try's error and the worker's death, and one long-polling Ray call per
(gateway, worker) carries both: it returns as soon as a try of that gateway failed here,
and Ray fails it when the worker's process dies. A Ray call per request cost each side
~0.5 ms of CPU (workers/inbox_wire.py).

The socket is one a peer can write to: every message carries a tag under the cluster
secret bound to this inbox's address (`auth.inbox_tag`), each sender's numbers must
rise (a recorded message is refused when sent again), and frames over a bound drop
the connection. A message that fails any of these is dropped unread and counted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

import zmq

from pdserve.workers.async_engine import (
    EngineDeadError,
    RequestAbortedError,
    RequestFaultError,
    WorkerDrainingError,
)
from pdserve.workers.decode_worker import PeerFailedError
from pdserve.workers.inbox_wire import AbortTry, StartTry, decode_inbox
from pdserve.workers.link_monitor import apply_limits
from pdserve.workers.token_stream import StreamLostError
from pdserve.workers.transfer import auth
from pdserve.workers.transfer.auth import ClusterSecret, SeqWindow

log = logging.getLogger(__name__)

# A start message is a prompt and its parameters (a grammar spec at most 64k characters).
MAX_INBOX_MESSAGE_BYTES = 4 << 20
RECEIVE_HWM = 10_000  # messages queued per sender connection before it is read no more
_DRAIN_BOUND = 64  # messages taken per wake before other callbacks run
# Failures kept for a gateway until it polls them: one that never polls again (gone)
# holds at most this many, and is forgotten after `_FORGET_S` without a poll.
_MAX_KEPT = 4096
_FORGET_S = 600.0
_MAX_SENDERS = 4096  # replay windows kept (a gateway replica's channel is one sender per worker life)

# Errors a try can end with, by kind: the gateway raises the same type (cluster/worker_channel.py).
# Most specific first: a subclass is matched before its base.
ERROR_KINDS: tuple[tuple[str, type[BaseException]], ...] = (
    ("engine_dead", EngineDeadError),
    ("fault", RequestFaultError),
    ("draining", WorkerDrainingError),
    ("stream_lost", StreamLostError),
    ("aborted", RequestAbortedError),
    ("peer_failed", PeerFailedError),
    ("timeout", TimeoutError),  # a worker's RequestTimeoutError too
    ("value", ValueError),
)


@dataclass(frozen=True)
class TryFailed:
    """A try that ended here with an error (`kind`: ERROR_KINDS', or "error")."""

    request_id: str
    attempt: int
    kind: str
    message: str

    @classmethod
    def of(cls, request_id: str, attempt: int, error: BaseException) -> TryFailed:
        kind = next((k for k, t in ERROR_KINDS if isinstance(error, t)), "error")
        return cls(request_id, attempt, kind, str(error) or type(error).__name__)

    def error(self) -> BaseException:
        """The exception the gateway raises for it (RuntimeError for a kind it does not know)."""
        return dict(ERROR_KINDS).get(self.kind, RuntimeError)(self.message)


@dataclass(frozen=True)
class Outcomes:
    """One long poll's answer: the worker process that answered, and the failed tries."""

    incarnation: str
    failed: tuple[TryFailed, ...]


@dataclass
class _Kept:
    failed: collections.deque[TryFailed]
    wake: asyncio.Event
    polled_at: float


Runner = Callable[[StartTry], Awaitable[None]]
Aborter = Callable[[str, int], None]


class WorkerInbox:
    """The PULL socket, bound on `host` when `open`ed on the worker's event loop. Each start
    runs `run(start)` in a task of its own (an abort cancels it: one that has not begun
    never does); each abort also calls `abort(request_id, attempt)` (the engine's)."""

    def __init__(self, run: Runner, abort: Aborter, secret: ClusterSecret, host: str, incarnation: str) -> None:
        self._run, self._abort, self._secret = run, abort, secret
        self.host, self.incarnation = host, incarnation
        self.address: str | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: dict[str, tuple[int, asyncio.Task[None]]] = {}  # request id -> its try here
        self._kept: dict[str, _Kept] = {}  # gateway (its token stream) -> failures not yet polled
        self._senders: collections.OrderedDict[str, SeqWindow] = collections.OrderedDict()
        self.num_forged = 0  # messages whose tag did not check
        self.num_replayed = 0  # messages with a number their sender had used
        self.num_rejected = 0  # signed messages that were not a valid inbox message

    def open(self) -> str:
        """Bind (once) and start reading on the running loop; the inbox's address."""
        if self.address is not None:
            return self.address
        self._loop = asyncio.get_running_loop()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        apply_limits(sock, max_frame_bytes=MAX_INBOX_MESSAGE_BYTES, rcvhwm=RECEIVE_HWM)
        port = sock.bind_to_random_port(f"tcp://{self.host}")
        self._sock, self.address = sock, f"tcp://{self.host}:{port}"
        self._loop.add_reader(sock.fileno(), self._drain)
        self._loop.call_soon(self._drain)  # edge-triggered FD: arm it (see token_collector)
        return self.address

    async def outcomes(self, gateway: str, timeout_s: float) -> Outcomes:
        """The failures of `gateway`'s tries since its last poll; waits up to `timeout_s`
        for one when there is none."""
        if not isinstance(gateway, str) or not 0 <= timeout_s <= 300:
            raise ValueError("outcomes: a gateway address and a timeout in [0, 300] s")
        kept = self._kept_for(gateway)
        kept.polled_at = time.monotonic()
        if not kept.failed:
            kept.wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await kept.wake.wait()
        failed = tuple(kept.failed)
        kept.failed.clear()
        kept.polled_at = time.monotonic()
        return Outcomes(self.incarnation, failed)

    @property
    def num_tries(self) -> int:
        return len(self._tasks)

    def close(self) -> None:
        for _, task in self._tasks.values():
            task.cancel()
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                with contextlib.suppress(Exception):  # closing from another thread or a closed loop
                    self._loop.remove_reader(self._sock.fileno())
            self._sock.close(linger=0)
            self._sock = None

    # -- reading --------------------------------------------------------------------------

    def _drain(self) -> None:
        for _ in range(_DRAIN_BOUND):
            sock = self._sock
            # ZMQ_EVENTS, not the FD (which only wakes): is a whole message there?
            if sock is None or not cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._take(parts)
            except Exception:  # a bug here must not leave the socket undrained (its FD would not wake again)
                log.exception("inbox: a message could not be handled")
        assert self._loop is not None
        self._loop.call_soon(self._drain)

    def _take(self, parts: list[bytes]) -> None:
        assert self.address is not None
        if len(parts) != 2 or not auth.inbox_check(self._secret, self.address, parts[0], parts[1]):
            self.num_forged += 1
            if self.num_forged & (self.num_forged - 1) == 0:  # 1, 2, 4, ...: a flood does not flood the log
                log.warning("inbox: dropped a message whose MAC does not check (%d so far)", self.num_forged)
            return
        try:
            msg = decode_inbox(parts[1])
        except ValueError as e:
            self.num_rejected += 1
            log.warning("inbox: dropped a bad message: %s", e)
            return
        window = self._senders.get(msg.sender)
        if window is None:
            window = self._senders[msg.sender] = SeqWindow(-1)
            if len(self._senders) > _MAX_SENDERS:
                self._senders.popitem(last=False)
        if not window.fresh(msg.seq):
            self.num_replayed += 1
            log.warning("inbox: refused message %d from %s again (replayed)", msg.seq, msg.sender)
            return
        window.take(msg.seq)
        self._senders.move_to_end(msg.sender)
        if isinstance(msg, AbortTry):
            self._cancel(msg.request_id, msg.attempt)
            self._abort(msg.request_id, msg.attempt)
        else:
            self._start(msg)

    def _start(self, start: StartTry) -> None:
        req = start.request  # an earlier try still here is ended by the engine as this one opens
        assert self._loop is not None
        task = self._loop.create_task(self._serve(start))
        self._tasks[req.request_id] = (req.attempt, task)
        task.add_done_callback(functools.partial(self._done, req.request_id))

    def _cancel(self, request_id: str, attempt: int) -> None:
        held = self._tasks.get(request_id)
        if held is not None and held[0] <= attempt:
            held[1].cancel()

    def _done(self, request_id: str, task: asyncio.Task[None]) -> None:
        held = self._tasks.get(request_id)
        if held is not None and held[1] is task:
            del self._tasks[request_id]

    async def _serve(self, start: StartTry) -> None:
        req = start.request
        try:
            await self._run(start)
        except Exception as e:  # noqa: BLE001 - every failure goes to the gateway, as a Ray call's would
            if not isinstance(e, (ValueError, TimeoutError, RequestAbortedError, WorkerDrainingError)):
                log.warning("request %s (try %d) failed here: %r", req.request_id, req.attempt, e)
            self._fail(req.reply_to, TryFailed.of(req.request_id, req.attempt, e))

    def _fail(self, gateway: str, failed: TryFailed) -> None:
        kept = self._kept_for(gateway)
        kept.failed.append(failed)
        kept.wake.set()

    def _kept_for(self, gateway: str) -> _Kept:
        kept = self._kept.get(gateway)
        if kept is None:
            now = time.monotonic()
            for gone in [g for g, k in self._kept.items() if now - k.polled_at > _FORGET_S]:
                del self._kept[gone]
            kept = self._kept[gateway] = _Kept(collections.deque(maxlen=_MAX_KEPT), asyncio.Event(), now)
        return kept
