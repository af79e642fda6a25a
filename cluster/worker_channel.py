"""A gateway's way to start requests on one worker: its inbox, and one long poll.

`run(req, finished)` sends the try to the worker's inbox (cluster/worker_inbox.py) and
returns when the collector saw its final delta (`finished`), or raises what ended it
instead: the try's error, which the worker reports on the long poll, or RayActorError
when the worker's process died (the poll fails, or another process answers it). That
is what the Ray call per request said before, at a fraction of its CPU
(workers/inbox_wire.py has the figures).

The channel connects on first use: `info()` gives the inbox's address and the worker
process's incarnation, and the poll starts. When the worker dies, every try on it fails
at once (the gateway moves them), and the next `run` connects again, to the restarted
process's new inbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import TYPE_CHECKING, Protocol, cast

import zmq

from pdserve.cluster.ray_errors import RayActorError
from pdserve.workers.inbox_wire import encode_abort, encode_start
from pdserve.workers.link_monitor import apply_heartbeats, apply_limits
from pdserve.workers.token_stream import StreamLostError
from pdserve.workers.transfer import auth
from pdserve.workers.transfer.auth import ClusterSecret

if TYPE_CHECKING:
    from pdserve.cluster.reports import WorkerInfo
    from pdserve.cluster.worker_handle import PoolWorkerHandle, PrefillHandle, RemoteMethod
    from pdserve.cluster.worker_inbox import Outcomes
    from pdserve.workers.handoff import ServeRequest

log = logging.getLogger(__name__)

POLL_S = 20.0  # how long one long poll waits on the worker for a failure
# The gateway's own deadline on a poll or an `info` call, beyond the worker's wait: a
# saturated node answers late; one that never answers (stopped) is the stall watch's.
_CALL_GRACE_S = 30.0
SEND_HWM = 10_000  # starts and aborts queued for a worker not reading them: then tries fail


class InboxWorker(Protocol):
    """What the channel calls on a worker's handle (cluster/actors.py `_Service`)."""

    @property
    def info(self) -> RemoteMethod[[], WorkerInfo]: ...

    @property
    def outcomes(self) -> RemoteMethod[[str, float], Outcomes]: ...


class WorkerChannel:
    """One gateway's channel to one worker. `gateway`: this gateway's token-stream
    address (the worker keeps failures per gateway). Use it on one event loop."""

    def __init__(self, worker: InboxWorker, gateway: str, secret: ClusterSecret | None = None) -> None:
        self.worker, self.gateway = worker, gateway
        self._secret = auth.resolve(secret)
        self._sender = os.urandom(8).hex()  # numbers rise per sender: a new one per channel
        self._seq = 0
        self._sock: zmq.Socket[bytes] | None = None
        self._address: str | None = None  # the inbox, while connected
        self._connecting: asyncio.Task[None] | None = None
        self._poller: asyncio.Task[None] | None = None
        self._tries: dict[tuple[str, int], asyncio.Future[None]] = {}
        self._met: set[str] = set()  # prefill workers this life of the worker was handed (`meet`)
        self._closed = False

    @property
    def connected(self) -> bool:
        return self._address is not None

    async def run(self, req: ServeRequest, finished: asyncio.Event,
                  prefill: tuple[str, PrefillHandle] | None = None) -> None:
        """Start `req` on the worker; return once `finished` is set (its final delta was
        handed on), raise the try's error or the worker's death (RayActorError).
        `prefill`: a handoff's prefill worker (its name and handle): the worker is
        introduced to it once per life (`meet`), and the start names it."""
        if req.reply_to != self.gateway:  # the worker reports its failure to the reply_to's poll
            raise ValueError(f"reply_to: {req.reply_to!r} is not this channel's gateway {self.gateway!r}")
        await self._connect()
        if prefill is not None and prefill[0] not in self._met:
            # A decode worker cannot look a peer up by name without Ray (a lent GPU's served check
            # runs without it): handed the handle once, it keeps it for this life.
            await cast("PoolWorkerHandle", self.worker).meet.remote(prefill[0], prefill[1])
            self._met.add(prefill[0])
        key = (req.request_id, req.attempt)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tries[key] = fut
        done: asyncio.Future[bool] = asyncio.ensure_future(finished.wait())
        try:
            self._send(encode_start(self._sender, self._next_seq(), req, None if prefill is None else prefill[0]))
            await asyncio.wait((fut, done), return_when=asyncio.FIRST_COMPLETED)
            if not finished.is_set():
                fut.result()
        finally:
            done.cancel()
            if self._tries.get(key) is fut:
                del self._tries[key]

    def abort(self, request_id: str, attempt: int) -> bool:
        """Send the worker an abort of the try (after its start, on the same socket); False
        when not connected (the worker died: its tries with it)."""
        if self._sock is None:
            return False
        with contextlib.suppress(StreamLostError):
            self._send(encode_abort(self._sender, self._next_seq(), request_id, attempt))
        return True

    async def close(self) -> None:
        self._closed = True
        for task in (self._poller, self._connecting):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._disconnect()

    # -- connecting -------------------------------------------------------------------------

    async def _connect(self) -> None:
        while self._address is None:
            if self._closed:
                raise RuntimeError("the gateway is closing")
            if self._connecting is None:
                self._connecting = asyncio.create_task(self._open())
            # Shielded: one caller leaving (its client gone) does not stop the others' connect.
            await asyncio.shield(self._connecting)

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
            sock.connect(info.inbox)
            self._sock, self._address = sock, info.inbox
            self._met.clear()  # a new life knows no peer yet
            self._poller = asyncio.create_task(self._poll(info.incarnation))
        finally:
            self._connecting = None

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock, self._address = None, None

    # -- the long poll ----------------------------------------------------------------------

    async def _poll(self, incarnation: str) -> None:
        """Hand each reported failure to its try, until the worker dies (or another process
        answers: the one the tries went to died between two polls)."""
        while not self._closed:
            try:
                async with asyncio.timeout(POLL_S + _CALL_GRACE_S):
                    out = await self.worker.outcomes.remote(self.gateway, POLL_S)
            except TimeoutError:
                log.warning("worker inbox %s: a poll went unanswered; polling again", self._address)
                continue
            except Exception as e:  # noqa: BLE001 - dead (RayActorError), or broken: its tries go elsewhere
                if not isinstance(e, RayActorError):
                    log.error("worker inbox %s: its poll failed: %r", self._address, e)
                self._lost()
                return
            if out.incarnation != incarnation:
                self._lost()
                return
            for failed in out.failed:
                fut = self._tries.get((failed.request_id, failed.attempt))
                if fut is not None and not fut.done():
                    fut.set_exception(failed.error())

    def _lost(self) -> None:
        """The worker process is gone: every try on it fails as a Ray call to it would."""
        self._disconnect()
        self._poller = None
        for fut in self._tries.values():
            if not fut.done():
                fut.set_exception(RayActorError())

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _send(self, body: bytes) -> None:
        if self._sock is None or self._address is None:
            raise RayActorError()  # lost between the connect and the send
        try:
            self._sock.send_multipart([auth.inbox_tag(self._secret, self._address, body), body], zmq.NOBLOCK)
        except zmq.Again:
            raise StreamLostError("the worker's inbox is full (it reads nothing)") from None
