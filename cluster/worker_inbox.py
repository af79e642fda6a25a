"""A worker's inbox: where gateways start and abort its requests without a Ray call each.

    gateway (cluster/worker_channel.py)               worker (this module)
    StartTry / AbortTry   --PUSH, signed-->           PULL socket -> a task per try
    tokens, the final one included  <--token stream-- (workers/token_stream.py)
    outcomes(gateway)     --one Ray call, long-poll-> what became of its tries here (taken,
                                                      done, failed), and the worker's death

A try's success is its final delta on the token stream; what is left for the control
plane is a try's error and the worker's death, and one long-polling Ray call per
(gateway, worker) carries both: it returns as soon as a try of that gateway failed here,
and Ray fails it when the worker's process dies. It also carries, at its own pace (at
least every poll's wait), which tries the worker took and which it finished: a start
lost on the way, or a final delta lost after it was sent, fails its try within seconds
instead of at the request's deadline. Reports are numbered per gateway and dropped only
once a poll acknowledges them (`after`), so a poll whose answer was lost (its caller gave
up on it) loses nothing. A Ray call per request cost each side ~0.5 ms of CPU
(workers/inbox_wire.py).

The socket is one a peer can write to: every message carries a tag under the cluster
secret bound to this inbox's address and process (`tag_address`), each sender's numbers must
rise (a recorded message is refused when sent again), and frames over a bound drop
the connection. A message that fails any of these is dropped unread and counted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import zmq

from pdserve.workers.async_engine import (
    EngineDeadError,
    RequestAbortedError,
    RequestFaultError,
    WorkerDrainingError,
)
from pdserve.workers.decode_worker import PeerFailedError
from pdserve.workers.inbox_wire import MAX_INBOX_MESSAGE_BYTES, AbortTry, StartTry, decode_inbox
from pdserve.workers.link_monitor import apply_limits
from pdserve.workers.token_stream import StreamLostError
from pdserve.workers.transfer import auth
from pdserve.workers.transfer.auth import ClusterSecret, SeqWindow
from pdserve.workers.zmq_drain import drain

log = logging.getLogger(__name__)

RECEIVE_HWM = 1000  # messages queued per sender connection before it is read no more
# Reports kept for a gateway until a poll acknowledges them: one that never polls again
# (gone) holds at most this many, and is forgotten after `_FORGET_S` without a poll. A poll
# returns early once `_WAKE_AT` are waiting, so a live gateway never comes near the bound.
_MAX_KEPT = 65_536
_WAKE_AT = 1024
_FORGET_S = 600.0
_MAX_SENDERS = 4096  # replay windows kept (a gateway replica's channel is one sender per worker life)
# Aborts remembered for a start not taken yet: a Ray abort (a gateway whose channel could not take
# it) can overtake the start it ends, which is then refused. The oldest are forgotten first.
_ABORTS_KEPT = 4096

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


STARTED, DONE, FAILED, ABORTED = "started", "done", "failed", "aborted"


def error_kind(error: BaseException) -> str:
    """Its ERROR_KINDS name; "error" for any other (the gateway raises a RuntimeError: a 500)."""
    return next((k for k, t in ERROR_KINDS if isinstance(error, t)), "error")


def blamed(error: Exception, engine_error: BaseException | None) -> Exception:
    """What a try that failed here failed of. While this worker's engine is dead, an error of
    no known kind is what the try tripped over on the way out (a KV registration the death
    freed): the death is the cause, the client must not get a 500 for it, and the gateway
    moves a request whose engine died."""
    if engine_error is None or error_kind(error) != "error":
        return error
    return EngineDeadError(f"engine failed: {engine_error!r} (the try then raised {error!r})")


@dataclass(frozen=True)
class TryReport:
    """What became of a try here: `state` STARTED (taken from the inbox), DONE (its final
    delta sent), FAILED (with the error's `kind`, ERROR_KINDS' or "error", and message) or
    ABORTED (an abort ended it: the gateway's proof that its abort arrived).
    `seq` numbers the reports of one gateway."""

    seq: int
    request_id: str
    attempt: int
    state: str
    kind: str = ""
    message: str = ""

    @classmethod
    def failed(cls, seq: int, request_id: str, attempt: int, error: BaseException) -> TryReport:
        return cls(seq, request_id, attempt, FAILED, error_kind(error), str(error) or type(error).__name__)

    def error(self) -> BaseException:
        """The exception the gateway raises for it (RuntimeError for a kind it does not know)."""
        return dict(ERROR_KINDS).get(self.kind, RuntimeError)(self.message)


@dataclass(frozen=True)
class Outcomes:
    """One long poll's answer: the worker process that answered, and the reports after
    the one the poll acknowledged."""

    incarnation: str
    reports: tuple[TryReport, ...]


@dataclass
class _Kept:
    reports: collections.deque[TryReport]
    wake: asyncio.Event
    polled_at: float
    next_seq: int = 1


Runner = Callable[[StartTry], Awaitable[None]]
Aborter = Callable[[str, int | None], None]


class WorkerInbox:
    """The PULL socket, bound on `host` when `open`ed on the worker's event loop. Each start
    runs `run(start)` in a task of its own (an abort cancels it: one that has not begun
    never does); each abort also calls `abort(request_id, attempt)` (the engine's)."""

    def __init__(self, run: Runner, abort: Aborter, secret: ClusterSecret, host: str, incarnation: str,
                 engine_error: Callable[[], BaseException | None] = lambda: None) -> None:
        self._run, self._abort, self._secret = run, abort, secret
        self._engine_error = engine_error  # what ended this worker's engine (None while it runs): `blamed`
        self.host, self.incarnation = host, incarnation
        self.address: str | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: dict[str, tuple[int, asyncio.Task[None]]] = {}  # request id -> its try here
        self._kept: dict[str, _Kept] = {}  # gateway (its token stream) -> reports not yet acknowledged
        self._senders: collections.OrderedDict[str, SeqWindow] = collections.OrderedDict()
        self._aborted: collections.OrderedDict[str, int] = collections.OrderedDict()  # request id -> last try aborted
        self.num_forged = 0  # messages whose tag did not check
        self.num_replayed = 0  # messages with a number their sender had used
        self.num_rejected = 0  # signed messages that were not a valid inbox message

    @property
    def tag_address(self) -> str:
        """What a message's tag is bound to: this inbox's address and this process's life (a
        restarted worker that got the same port takes nothing meant for the last one)."""
        return f"{self.address}#{self.incarnation}"

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

    async def outcomes(self, gateway: str, after: int, timeout_s: float) -> Outcomes:
        """`gateway`'s reports numbered above `after` (those up to it are dropped: the poll
        acknowledges them); waits up to `timeout_s` while none is a failure (and fewer than
        `_WAKE_AT` wait)."""
        if not isinstance(gateway, str) or not isinstance(after, int) or not 0 <= timeout_s <= 300:
            raise ValueError("outcomes: a gateway address, a report number and a timeout in [0, 300] s")
        kept = self._kept_for(gateway)
        kept.polled_at = time.monotonic()
        while kept.reports and kept.reports[0].seq <= after:
            kept.reports.popleft()
        if not any(r.state == FAILED for r in kept.reports) and len(kept.reports) < _WAKE_AT:
            kept.wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await kept.wake.wait()
        kept.polled_at = time.monotonic()
        return Outcomes(self.incarnation, tuple(kept.reports))  # all above `after`: the rest went

    @property
    def num_tries(self) -> int:
        return len(self._tasks)

    def close(self) -> None:
        for _, task in self._tasks.values():
            task.cancel()
        for kept in self._kept.values():
            kept.wake.set()  # its polls answer now (the process is stopping)
        self.address = None
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                with contextlib.suppress(Exception):  # closing from another thread or a closed loop
                    self._loop.remove_reader(self._sock.fileno())
            self._sock.close(linger=0)
            self._sock = None

    # -- reading --------------------------------------------------------------------------

    def _drain(self) -> None:
        assert self._loop is not None
        drain(self._loop, lambda: self._sock, self._take, "inbox")

    def _take(self, parts: list[bytes]) -> None:
        assert self.address is not None
        if len(parts) != 2 or not auth.inbox_check(self._secret, self.tag_address, parts[0], parts[1]):
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
            self.abort(msg.request_id, msg.attempt)
        else:
            self._start(msg)

    def _start(self, start: StartTry) -> None:
        req = start.request  # an earlier try still here is ended by the engine as this one opens
        if req.attempt <= self._aborted.get(req.request_id, -1):  # its abort came first (by Ray)
            self._report(req.reply_to, req.request_id, req.attempt, FAILED,
                         RequestAbortedError(f"request {req.request_id} (try {req.attempt}) was aborted before "
                                             "it started"))
            return
        self._report(req.reply_to, req.request_id, req.attempt, STARTED)
        assert self._loop is not None
        task = self._loop.create_task(self._serve(start))
        self._tasks[req.request_id] = (req.attempt, task)
        task.add_done_callback(functools.partial(self._done, req.request_id))

    def abort(self, request_id: str, attempt: int | None = None) -> None:
        """End try `attempt` (or an earlier one; None: any) of `request_id` here: its task and
        the engine's request, and a start of it still to come. An abort message does this, and
        so must the worker's `abort` Ray call (the gateway's way where its channel is down): the
        engine's abort ends only a request it holds, and a try still on its way in (its grammar
        compiling, or its start queued behind a full inbox) went on."""
        self._remember_abort(request_id, attempt)
        self._cancel(request_id, attempt)
        self._abort(request_id, attempt)

    def _remember_abort(self, request_id: str, attempt: int | None) -> None:
        """Keep the abort for a start that comes after it (`_start` refuses it), bounded."""
        last = max(self._aborted.pop(request_id, -1), sys.maxsize if attempt is None else attempt)
        self._aborted[request_id] = last
        if len(self._aborted) > _ABORTS_KEPT:
            self._aborted.popitem(last=False)

    def _cancel(self, request_id: str, attempt: int | None) -> None:
        held = self._tasks.get(request_id)
        if held is not None and (attempt is None or held[0] <= attempt):
            held[1].cancel()

    def _done(self, request_id: str, task: asyncio.Task[None]) -> None:
        held = self._tasks.get(request_id)
        if held is not None and held[1] is task:
            del self._tasks[request_id]

    async def _serve(self, start: StartTry) -> None:
        req = start.request
        try:
            await self._run(start)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                # An abort (or the inbox closing) cancelled it: no one waits on it, but after an abort
                # its gateway learns, at the poll's own pace, that the abort arrived (else it sends it
                # again). Closing says nothing: the worker's death moves the try.
                if req.attempt <= self._aborted.get(req.request_id, -1):
                    self._report(req.reply_to, req.request_id, req.attempt, ABORTED)
                raise
            # Cancelled from inside: work it awaited was (a role's wait threads shut down as the worker
            # changed role). The try is over here, and its gateway must hear it now, not at its deadline:
            # it moves on from what its client has.
            log.warning("request %s (try %d): its work here was cancelled", req.request_id, req.attempt)
            self._report(req.reply_to, req.request_id, req.attempt, FAILED,
                         StreamLostError(f"request {req.request_id}: its work on the worker was cancelled"))
        except Exception as e:  # noqa: BLE001 - every failure goes to the gateway, as a Ray call's would
            if not isinstance(e, (ValueError, TimeoutError, RequestAbortedError, WorkerDrainingError)):
                log.warning("request %s (try %d) failed here: %r", req.request_id, req.attempt, e)
            self._report(req.reply_to, req.request_id, req.attempt, FAILED, blamed(e, self._engine_error()))
        else:
            self._report(req.reply_to, req.request_id, req.attempt, DONE)

    def _report(self, gateway: str, request_id: str, attempt: int, state: str,
                error: BaseException | None = None) -> None:
        kept = self._kept_for(gateway)
        seq, kept.next_seq = kept.next_seq, kept.next_seq + 1
        kept.reports.append(TryReport(seq, request_id, attempt, state) if error is None
                            else TryReport.failed(seq, request_id, attempt, error))
        if error is not None or len(kept.reports) >= _WAKE_AT:
            kept.wake.set()

    def _kept_for(self, gateway: str) -> _Kept:
        kept = self._kept.get(gateway)
        if kept is None:
            now = time.monotonic()
            for gone in [g for g, k in self._kept.items() if now - k.polled_at > _FORGET_S]:
                del self._kept[gone]
            kept = self._kept[gateway] = _Kept(collections.deque(maxlen=_MAX_KEPT), asyncio.Event(), now)
        return kept
