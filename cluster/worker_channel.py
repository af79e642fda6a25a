"""A gateway's way to start requests on one worker: its inbox, and one long poll.

`run(req, finished)` sends the try to the worker's inbox (cluster/worker_inbox.py) and
returns when the collector saw its final delta (`finished`) or the worker reports the
try done (the collector's `watch` then gives the final delta a grace), or raises what
ended it instead: the try's error, which the worker reports on the long poll, or
RayActorError when the worker's process died (the poll fails, or another process
answers it). That is what the Ray call per request said before, at a fraction of its
CPU (workers/inbox_wire.py has the figures). A start the worker never reports taking
(lost on the way) fails its try with StreamLostError after `START_CONFIRM_S`, so the
gateway moves it rather than wait for the request's deadline.

The channel connects on first use: `info()` gives the inbox's address and the worker
process's incarnation, and the poll starts. When the worker dies, every try on it fails
at once (the gateway moves them), and the next `run` connects again, to the restarted
process's new inbox.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import zmq

from pdserve.cluster.ray_errors import RayActorError
from pdserve.cluster.worker_inbox import ABORTED, DONE, FAILED, STARTED, TryReport
from pdserve.workers.async_engine import RequestAbortedError
from pdserve.workers.inbox_wire import MAX_INBOX_MESSAGE_BYTES, encode_abort, encode_start
from pdserve.workers.link_monitor import LinkMonitor, apply_heartbeats, apply_limits
from pdserve.workers.token_stream import StreamLostError
from pdserve.workers.transfer import auth
from pdserve.workers.transfer.auth import ClusterSecret

if TYPE_CHECKING:
    from pdserve.cluster.reports import WorkerInfo
    from pdserve.cluster.worker_handle import PoolWorkerHandle, PrefillHandle, RemoteMethod
    from pdserve.cluster.worker_inbox import Outcomes
    from pdserve.workers.handoff import ServeRequest

log = logging.getLogger(__name__)

# How long one long poll waits on the worker while none of this gateway's tries failed:
# what it learnt meanwhile (tries taken, tries done) comes back at least this often.
POLL_S = 5.0
# The gateway's own deadline on a poll or an `info` call, beyond the worker's wait: a
# saturated node answers late; one that never answers (stopped) is the stall watch's.
_CALL_GRACE_S = 30.0
# A start the worker has not reported taking this long after it was sent was lost (the
# poll brings reports every POLL_S): its try fails with StreamLostError and moves.
START_CONFIRM_S = 30.0
SEND_HWM = 10_000  # starts and aborts queued for a worker not reading them: then tries fail
_ABORTS_KEPT = 4096  # aborts remembered for a start not yet sent (it is then not sent)
# An abort the worker has not answered (its try reported failed or done) this long after it was sent
# was lost on the way (a connection dropped and made again loses what was in flight): it is sent
# again, at most _ABORT_RESENDS times. A lost abort left its try decoding for no one to its end.
ABORT_CONFIRM_S = 10.0
_ABORT_RESENDS = 3
# After the connection to an inbox drops, this long for the worker's death to be learnt (the
# poll's Ray call fails) before the tries it may not have taken fail as lost streams.
LINK_LOST_GRACE_S = 2.0
# A poll that failed without the worker's death (a Ray error of the call, not of the actor) is
# tried again after 0.5, 1, 2 s; the third failure in a row gives the worker up: its tries are
# aborted there (it is alive) and fail, to move elsewhere.
_POLL_RETRY_S = (0.5, 1.0, 2.0)


class InboxWorker(Protocol):
    """What the channel calls on a worker's handle (cluster/actors.py `_Service`)."""

    @property
    def info(self) -> RemoteMethod[[], WorkerInfo]: ...

    @property
    def outcomes(self) -> RemoteMethod[[str, int, float], Outcomes]: ...


@dataclass(eq=False)
class _Try:
    """A try sent on this channel: its outcome (`fut`), and whether the worker took it."""

    fut: asyncio.Future[None]
    sent_at: float
    started: bool = False


def _fd(monitor: LinkMonitor) -> int:
    """The file descriptor that signals the monitor's events (edge-triggered, as ZeroMQ's)."""
    return cast(int, monitor.socket.getsockopt(zmq.FD))


class WorkerChannel:
    """One gateway's channel to one worker. `gateway`: this gateway's token-stream
    address (the worker keeps its reports per gateway). Use it on one event loop."""

    def __init__(self, worker: InboxWorker, gateway: str, secret: ClusterSecret | None = None) -> None:
        self.worker, self.gateway = worker, gateway
        self._secret = auth.resolve(secret)
        self._sender = os.urandom(8).hex()  # numbers rise per sender: a new one per channel
        self._seq = 0
        self._sock: zmq.Socket[bytes] | None = None
        self._monitor: LinkMonitor | None = None  # the socket's connection, watched from the loop
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that reads the monitor
        self._address: str | None = None  # the inbox, while connected
        self._tag_address = ""  # what the tags are bound to: the inbox and its process's life
        self._life = 0  # counts connects and losses: what was learnt of one life is not the next's
        self._connecting: asyncio.Task[None] | None = None
        # A connect stopped by `fail_tries` or `discard`: what the tries waiting on it fail with
        # (kept with that connect: a next one may start before they wake).
        self._stopped_connects: weakref.WeakKeyDictionary[asyncio.Task[None], Callable[[], BaseException]] = (
            weakref.WeakKeyDictionary())
        self._poller: asyncio.Task[None] | None = None
        self._tries: dict[tuple[str, int], _Try] = {}
        self._unconfirmed: collections.deque[tuple[tuple[str, int], _Try]] = collections.deque()  # in sending order
        self._acked = 0  # the last report of this life handled (the next poll acknowledges it)
        self._aborted: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        # Aborts sent and not answered yet: (when last sent, how many times), oldest first.
        self._unanswered_aborts: collections.OrderedDict[tuple[str, int], tuple[float, int]] = (
            collections.OrderedDict())
        # Tries whose start was sent and that the worker has not reported over (done, failed, aborted),
        # oldest first: only their aborts have something to end there, and get an answer. An abort of
        # a try already over, or whose start was never sent, is sent once and not again.
        self._unreported: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self._met: set[str] = set()  # prefill workers this life of the worker was handed (`meet`)
        self._closed = False

    @property
    def connected(self) -> bool:
        return self._address is not None

    async def run(self, req: ServeRequest, finished: asyncio.Event,
                  prefill: tuple[str, PrefillHandle] | None = None) -> None:
        """Start `req` on the worker; return once `finished` is set (its final delta was
        handed on) or the worker reports the try done, raise the try's error or the
        worker's death (RayActorError). `prefill`: a handoff's prefill worker (its name
        and handle): the worker is introduced to it once per life (`meet`), and the start
        names it."""
        if req.reply_to != self.gateway:  # the worker reports its failure to the reply_to's poll
            raise ValueError(f"reply_to: {req.reply_to!r} is not this channel's gateway {self.gateway!r}")
        await self._connect()
        if prefill is not None and prefill[0] not in self._met:
            # A decode worker cannot look a peer up by name without Ray (a lent GPU's served check
            # runs without it): handed the handle once, it keeps it for this life.
            life = self._life
            await cast("PoolWorkerHandle", self.worker).meet.remote(prefill[0], prefill[1])
            if life == self._life:  # not a life that began meanwhile (it knows no peer)
                self._met.add(prefill[0])
        key = (req.request_id, req.attempt)
        if key in self._aborted:  # aborted while it connected: an abort sent before its start ends nothing
            raise RequestAbortedError(f"request {req.request_id} (try {req.attempt}) was aborted before it started")
        body = encode_start(self._sender, self._next_seq(), req, None if prefill is None else prefill[0])
        if len(body) > MAX_INBOX_MESSAGE_BYTES:  # the inbox would drop the connection, every try on it
            raise ValueError(f"the request is {len(body)} bytes encoded: over the {MAX_INBOX_MESSAGE_BYTES} "
                             "a worker takes")
        t = _Try(asyncio.get_running_loop().create_future(), time.monotonic())
        done: asyncio.Future[bool] = asyncio.ensure_future(finished.wait())
        try:
            self._send(body)
            self._tries[key] = t
            self._unreported[key] = None
            if len(self._unreported) > _ABORTS_KEPT:
                self._unreported.popitem(last=False)
            self._unconfirmed.append((key, t))
            await asyncio.wait((t.fut, done), return_when=asyncio.FIRST_COMPLETED)
            if not finished.is_set():
                t.fut.result()
        finally:
            done.cancel()
            if t.fut.done() and not t.fut.cancelled():
                t.fut.exception()  # seen: the final delta won the race
            if self._tries.get(key) is t:
                del self._tries[key]

    def abort(self, request_id: str, attempt: int) -> bool:
        """Send the worker an abort of the try (after its start, on the same socket; a start
        not sent yet is not sent). False when it cannot go (not connected: the worker died,
        its tries with it; or its inbox is full): then the caller tells the worker otherwise."""
        self._aborted[(request_id, attempt)] = None
        if len(self._aborted) > _ABORTS_KEPT:
            self._aborted.popitem(last=False)
        if self._sock is None:
            return False
        if not self._send_abort((request_id, attempt)):
            return False
        if (request_id, attempt) not in self._unreported:  # nothing there to end: no answer will come
            return True
        self._unanswered_aborts[(request_id, attempt)] = (time.monotonic(), 1)
        if len(self._unanswered_aborts) > _ABORTS_KEPT:
            self._unanswered_aborts.popitem(last=False)
        return True

    def _send_abort(self, key: tuple[str, int]) -> bool:
        try:
            self._send(encode_abort(self._sender, self._next_seq(), key[0], key[1]))
        except (StreamLostError, RayActorError):
            return False
        return True

    def fail_tries(self, error: Callable[[], BaseException]) -> None:
        """Fail the tries on this channel now, each with a fresh `error()` (the worker was
        given up without having died: cluster/colocated_watch.py). The channel stays open.
        Tries still waiting for the channel to connect fail too: the connect is stopped
        (a stopped worker would hold them to its call deadline), and the next try connects
        again."""
        for t in self._tries.values():
            if not t.fut.done():
                t.fut.set_exception(error())
        self._stop_connect(error)

    def discard(self) -> None:
        """Stop at once (the worker's handle was replaced): the tries still on it fail as
        on its death, and nothing more is sent or polled."""
        self._closed = True
        if self._poller is not None:
            self._poller.cancel()
        self._stop_connect(RayActorError)
        self._lost()

    async def close(self) -> None:
        tasks = [t for t in (self._poller, self._connecting) if t is not None]
        self.discard()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- connecting -------------------------------------------------------------------------

    async def _connect(self) -> None:
        while self._address is None:
            if self._closed:
                raise RuntimeError("the gateway is closing")
            if self._connecting is None:
                self._connecting = asyncio.create_task(self._open())
                # Seen even when every caller left (their clients gone) before it ended.
                self._connecting.add_done_callback(lambda t: t.cancelled() or t.exception())
            connecting = self._connecting
            try:
                # Shielded: one caller leaving (its client gone) does not stop the others' connect.
                await asyncio.shield(connecting)
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if not connecting.cancelled() or (me is not None and me.cancelling()):
                    raise  # this caller was cancelled, not the connect
                raise self._stopped_connects.get(connecting, RayActorError)() from None

    def _stop_connect(self, error: Callable[[], BaseException]) -> None:
        """Stop a connect under way; the tries waiting on it fail with `error()`."""
        task = self._connecting
        if task is not None and not task.done():
            self._stopped_connects[task] = error
            task.cancel()

    async def _open(self) -> None:
        try:
            try:
                async with asyncio.timeout(_CALL_GRACE_S):
                    info = await self.worker.info.remote()
            except TimeoutError:
                raise StreamLostError("the worker did not say where its inbox is in time") from None
            if not info.inbox:
                raise RuntimeError("the worker has no inbox (a pdserve older than its gateway?)")
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            apply_limits(sock, max_frame_bytes=1024, sndhwm=SEND_HWM)  # the worker sends nothing back
            apply_heartbeats(sock)
            monitor = LinkMonitor(sock)  # before the connect: it sees every drop
            sock.connect(info.inbox)
            self._loop = loop = asyncio.get_running_loop()
            loop.add_reader(_fd(monitor), self._on_link_events)
            loop.call_soon(self._on_link_events)  # edge-triggered FD: arm it
            self._sock, self._monitor, self._address = sock, monitor, info.inbox
            self._tag_address = f"{info.inbox}#{info.incarnation}"  # cluster/worker_inbox.py `tag_address`
            self._life += 1
            self._met.clear()  # a new life knows no peer yet
            self._acked = 0  # its reports are numbered from 1
            self._poller = asyncio.create_task(self._poll(info.incarnation))
        finally:
            self._connecting = None

    def _disconnect(self) -> None:
        if self._monitor is not None:
            if self._loop is not None and not self._loop.is_closed():  # (closed: the process stopping)
                self._loop.remove_reader(_fd(self._monitor))
            self._monitor.close()
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock, self._monitor, self._address = None, None, None

    def _on_link_events(self) -> None:
        if self._monitor is not None and self._loop is not None and any(e.lost for e in self._monitor.poll()):
            self._loop.call_later(LINK_LOST_GRACE_S, self._link_lost, self._life, time.monotonic())

    def _link_lost(self, life: int, at: float) -> None:
        """The connection to the inbox dropped at `at` (the worker stopped or hung past the
        heartbeat timeout, or the network broke; ZeroMQ connects again by itself). What was on
        its way went with it: a start sent before then that the worker has not reported taking
        may never arrive, and its client would wait START_CONFIRM_S with no byte. Those tries
        fail, as lost streams (the gateway moves them), and each is aborted on the next
        connection (sent once: a start that did arrive ends there, and one that did not has
        nothing to answer). Called LINK_LOST_GRACE_S after the drop, and not at all if the
        worker's death was learnt meanwhile (`life` is over): its tries then fail as on a
        death, which takes the worker out of routing, so none moves back onto it."""
        if self._closed or life != self._life:
            return
        for key, t in list(self._unconfirmed):
            if t.sent_at > at or t.started or t.fut.done() or self._tries.get(key) is not t:
                continue
            t.fut.set_exception(StreamLostError(
                f"worker inbox {self._address}: the link dropped before the worker took request {key[0]} "
                f"(try {key[1]}); its start may be lost"))
            self._unreported.pop(key, None)
            self.abort(*key)

    # -- the long poll ----------------------------------------------------------------------

    async def _poll(self, incarnation: str) -> None:
        """Hand each report to its try, until the worker dies (or another process answers:
        the one the tries went to died between two polls). However the loop ends, but for
        the channel closing, the worker is taken for gone: no try waits on a poll that stopped.
        A worker given up alive (its poll failed, not of its death) is told to drop the tries
        first: moved elsewhere, they would otherwise decode there too, for no one."""
        alive = True  # whether the worker may still run the tries when the loop ends
        failures = 0  # polls failed in a row, not of the worker's death
        try:
            while not self._closed:
                try:
                    async with asyncio.timeout(POLL_S + _CALL_GRACE_S):
                        out = await self.worker.outcomes.remote(self.gateway, self._acked, POLL_S)
                except TimeoutError:
                    log.warning("worker inbox %s: a poll went unanswered; polling again", self._address)
                    self._sweep()
                    continue
                except RayActorError:
                    alive = False  # dead: its tries with it
                    return
                except Exception as e:  # noqa: BLE001 - a failed call, not a death: try again, a few times
                    if failures >= len(_POLL_RETRY_S):
                        log.error("worker inbox %s: its poll failed %d times in a row: %r; giving it up",
                                  self._address, failures + 1, e)
                        return
                    log.warning("worker inbox %s: its poll failed: %r; polling again", self._address, e)
                    await asyncio.sleep(_POLL_RETRY_S[failures])
                    failures += 1
                    self._sweep()
                    continue
                failures = 0
                if out.incarnation != incarnation:
                    alive = False  # another process answers: the one the tries went to died
                    return
                self._apply(out.reports)
                self._sweep()
        except Exception:
            log.exception("worker inbox %s: its poll broke", self._address)
        finally:
            if not self._closed:
                if alive:
                    for key in list(self._tries):
                        self._send_abort(key)
                self._lost()

    def _apply(self, reports: tuple[TryReport, ...]) -> None:
        for r in reports:
            if r.seq <= self._acked:  # handled already (the answer to an earlier poll had it too)
                continue
            self._acked = r.seq
            if r.state != STARTED:
                self._unanswered_aborts.pop((r.request_id, r.attempt), None)
                self._unreported.pop((r.request_id, r.attempt), None)
            t = self._tries.get((r.request_id, r.attempt))
            if t is None or t.fut.done():
                continue
            if r.state == FAILED:
                t.fut.set_exception(r.error())
            elif r.state == DONE:
                t.fut.set_result(None)  # the worker sent its final delta: `watch` gives it a grace
            elif r.state == STARTED:
                t.started = True
            elif r.state == ABORTED:
                t.fut.set_exception(RequestAbortedError(f"request {r.request_id} (try {r.attempt}) was aborted"))

    def _sweep(self) -> None:
        """Fail the tries whose start the worker has not reported taking in `START_CONFIRM_S`;
        send again the aborts it has not answered in `ABORT_CONFIRM_S`."""
        now = time.monotonic()
        while self._unanswered_aborts:
            key, (sent_at, sends) = next(iter(self._unanswered_aborts.items()))
            if sent_at > now - ABORT_CONFIRM_S:
                break
            del self._unanswered_aborts[key]
            if sends > _ABORT_RESENDS:
                log.warning("worker inbox %s: request %s (try %d): its abort was never answered", self._address,
                            key[0], key[1])
            elif self._send_abort(key):
                self._unanswered_aborts[key] = (now, sends + 1)  # (to the end: the order stays by time)
        cutoff = now - START_CONFIRM_S
        while self._unconfirmed and self._unconfirmed[0][1].sent_at < cutoff:
            key, t = self._unconfirmed.popleft()
            if not t.started and not t.fut.done() and self._tries.get(key) is t:
                t.fut.set_exception(StreamLostError(
                    f"worker inbox {self._address}: request {key[0]} (try {key[1]}) was not taken "
                    f"in {START_CONFIRM_S:.0f} s (its start was lost)"))

    def _lost(self) -> None:
        """The worker process is gone: every try on it fails as a Ray call to it would."""
        self._disconnect()
        self._poller = None
        self._life += 1
        self._unconfirmed.clear()
        self._unanswered_aborts.clear()  # its tries died with it
        self._unreported.clear()
        for t in self._tries.values():
            if not t.fut.done():
                t.fut.set_exception(RayActorError())

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _send(self, body: bytes) -> None:
        if self._sock is None or self._address is None:
            raise RayActorError()  # lost between the connect and the send
        try:
            self._sock.send_multipart([auth.inbox_tag(self._secret, self._tag_address, body), body], zmq.NOBLOCK)
        except zmq.Again:
            raise StreamLostError("the worker's inbox is full (it reads nothing)") from None
