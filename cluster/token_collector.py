"""The gateway's side of the token stream: one PULL socket that takes every
worker's signed `TokenDeltaBatch`es (workers/token_stream.py has the wire format
and the worker's publisher) and hands each delta to its request, in order.

A request here: `open` (its lifecycle, with the request's deadline), then
`consume` (its deltas, in order, to the client) while the backend's tries run it,
each awaited through `watch`: the one place that decides how a try ended (its
call's error, a broken stream, a final delta that never came, the deadline). The
backend turns that end into the request's end or a next try, from what was handed
on (`next_attempt`). Deltas of a try given up on are dropped; a batch missing from
a worker's numbering, or a worker that re-sends handed-on tokens differently,
breaks the tries it serves (`watch` raises StreamLostError; the backend moves
the request on).

Authentication (workers/transfer/auth.py): a message whose tag does not check is
dropped unread (`num_forged`), as is one whose number its publisher already used
(`num_replayed`). The PULL socket refuses frames over the message limit
(ZMQ_MAXMSGSIZE: the connection is dropped, `num_dropped`) and queues a bounded
number per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from pdserve.workers.handoff import Resume
from pdserve.workers.lifecycle import Exit, Lifecycle, RequestState
from pdserve.workers.link_monitor import apply_heartbeats, apply_limits
from pdserve.workers.messages import MAX_MESSAGE_BYTES, TokenDelta, TokenDeltaBatch
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.token_decode import decode_token_batch
from pdserve.workers.token_stream import StreamLostError, from_deltas
from pdserve.workers.transfer import auth
from pdserve.workers.transfer.auth import ClusterSecret
from pdserve.workers.zmq_drain import drain, readable

log = logging.getLogger(__name__)

# Messages the gateway's PULL queues per worker connection before it stops
# reading that connection (then the worker's SEND_HWM fills, and it gives up on
# that gateway's requests): bounded, so no peer can make the gateway hold more.
RECEIVE_HWM = 1000


@dataclass(frozen=True)
class Retry:
    """Where a request's next try starts (`TokenStreamCollector.next_attempt`)."""

    attempt: int
    resume: Resume | None  # what the client already has (None: nothing yet, start over)
    remaining_s: float  # of the request's deadline


@dataclass(eq=False)
class _Open:
    prompt_token_ids: list[int]
    life: Lifecycle
    # Deltas in offset order (then, once, the tries' end); the reader takes all of them at once
    # and builds one output (from_deltas). It is woken only when what it waits for is here
    # (`_put`): with --stream-interval N, once per N tokens, not once per token.
    queue: deque[TokenDelta | _RpcDone] = field(default_factory=deque)
    queued_tokens: int = 0  # output tokens in `queue`
    ends_queued: bool = False  # `queue` holds a final delta or the tries' end
    wake_at: int = 0  # the reader's wait ends at this many queued tokens (0: at any item)
    waiter: asyncio.Future[None] | None = None  # the reader's wait, while it waits
    next_offset: int = 0  # output tokens handed on so far: the offset the next delta must have
    held: list[TokenDelta] = field(default_factory=list)  # deltas that came early
    attempt: int = 0  # the try whose deltas are taken (ServeRequest.attempt)
    # What was handed on (what the client has, or will as it reads): where a migrated try resumes.
    token_ids: list[int] = field(default_factory=list)
    chars: int = 0
    cumulative_logprob: float | None = None
    senders: set[str] = field(default_factory=set)  # the workers that sent this try's deltas
    gaps_seen: int = 0  # the collector's `num_gaps` when this try began
    # Set when the current try can no longer be trusted to deliver every token: a batch
    # that may have held one of its deltas went missing, or it re-sent handed-on tokens
    # differently. Once its final delta was handed on it means nothing (`watch`).
    broken: asyncio.Event = field(default_factory=asyncio.Event)
    diverged: bool = False  # the try re-sent handed-on tokens differently: nothing more of it is taken
    finished: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _RpcDone:
    """Queued when the request's tries ended: with their error, or None once every token was handed on."""

    error: BaseException | None


class TokenStreamCollector:
    """Gateway side: one PULL socket, a reader task, a queue per open request.
    Create and use it on one event loop.

    Each open request has its gateway-side `Lifecycle`: QUEUED when opened,
    ROUTED once its worker call starts, DECODING from its first token, then
    FINISHED at its final delta, FAILED on an error or the deadline, ABORTED
    when its reader goes away. The caller hangs its exit hooks on it (the
    backend aborts the request on its workers).

    It takes only batches signed with `secret` (None: `auth.default_secret()`)
    for its own address, each publisher's numbers rising (module docstring)."""

    def __init__(self, bind_host: str = "127.0.0.1", final_grace_s: float = 5.0,
                 secret: ClusterSecret | None = None, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval: {stream_interval} must be at least 1")
        # A plain (not zmq.asyncio) socket drained from the loop's own reader on its FD: pyzmq's
        # asyncio socket adds and removes that reader and makes a future for every message, which
        # cost ~200 us of CPU more a message (a step) than draining here (docs/performance.md,
        # "The front door").
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._secret = auth.resolve(secret)
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        apply_limits(self._sock, max_frame_bytes=MAX_MESSAGE_BYTES, rcvhwm=RECEIVE_HWM)
        apply_heartbeats(self._sock)  # a dead worker's connection is dropped, not kept for ever
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{bind_host}:{port}"
        self.final_grace_s = final_grace_s
        # Output tokens a reader gathers before it yields (the first output and the final one go at
        # once): each yield is a chunk on the client's connection, and a chunk costs the gateway
        # more than a token (docs/front-door.md). vLLM's and SGLang's
        # --stream-interval; 1, the default, hands on whatever came.
        self.stream_interval = stream_interval
        self._open: dict[str, _Open] = {}
        self.num_rejected = 0  # messages that were not a valid TokenDeltaBatch
        self.num_out_of_order = 0  # deltas that overtook an earlier one of their request
        self.num_stale = 0  # deltas of a try given up on (a migrated request's old worker)
        self.num_gaps = 0  # batches missing from a worker's sequence (each breaks that worker's tries)
        self.num_diverged = 0  # repeats of handed-on tokens that differ from them (each breaks its try)
        self.num_forged = 0  # messages whose tag did not check (no secret, another secret, altered, another stream)
        self.num_replayed = 0  # signed batches whose number their publisher had already used
        self.num_dropped = 0  # connections lost (a frame over the size limit drops one; so does a worker leaving)
        self._next_seq: dict[str, int] = {}  # worker id -> the batch number it should send next
        self._loop = asyncio.get_running_loop()
        self._fds = (self._sock.fileno(), self._monitor.fileno())
        self._loop.add_reader(self._fds[0], self._drain)
        self._loop.add_reader(self._fds[1], self._drain_monitor)
        self._closed = False
        # A ZeroMQ FD is edge-triggered and signals only after ZMQ_EVENTS was read: take what came
        # before the readers, and arm both FDs.
        self._loop.call_soon(self._drain)
        self._loop.call_soon(self._drain_monitor)

    def open(self, request_id: str, prompt_token_ids: list[int], timeout_s: float) -> Lifecycle:
        """Start collecting `request_id`'s deltas, before any worker can send one;
        returns its lifecycle here. `consume` reads them and closes it."""
        if request_id in self._open:
            raise ValueError(f"request_id: {request_id!r} is already streaming")
        life = Lifecycle.start(request_id, timeout_s)
        self._open[request_id] = _Open(prompt_token_ids, life, gaps_seen=self.num_gaps)
        return life

    async def consume(self, request_id: str, tries: Awaitable[Any]) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's DELTA outputs (it must be `open`), in order, until the
        final one. `tries` runs the request on its workers and returns only once every
        token was handed on: it awaits each try through `watch` (the backend's retry
        loop; a lone try is `watch(request_id, call)`). Its error ends the stream, after
        the deltas that came before it. However this ends, the request's lifecycle
        ends with it."""
        entry = self._open[request_id]
        life = entry.life
        rpc = asyncio.ensure_future(tries)
        rpc.add_done_callback(lambda f: _put(entry, _RpcDone(None if f.cancelled() else f.exception())))
        life.move(RequestState.ROUTED)
        exit = Exit.ABORTED  # unless it ends below: the reader went away (client gone)
        try:
            async with contextlib.aclosing(self._ordered(request_id, entry, self.stream_interval)) as ordered:
                async for out in ordered:
                    if out.outputs[0].token_ids:
                        life.advance(RequestState.DECODING)
                    if out.finished:
                        exit = Exit.FINISHED
                    yield out
        except TimeoutError:
            exit = Exit.DEADLINE
            raise
        except ValueError:  # the worker refused the request
            exit = Exit.REJECTED
            raise
        except Exception:
            exit = Exit.PEER_FAILED
            raise
        finally:
            self._open.pop(request_id, None)
            if not rpc.done():
                rpc.cancel()
            life.end(exit)

    @staticmethod
    async def _ordered(request_id: str, entry: _Open, interval: int = 1) -> AsyncGenerator[RequestOutput, None]:
        """The entry's outputs until the final one, then the tries' error if they failed.
        Each output merges what is queued (a reader that is behind), and after the first
        waits until it has `interval` tokens, its final delta, or the tries' end. No timer
        here: `watch` bounds each try by the request's deadline, so the tries end (and say
        so on the queue) by then."""
        wake_at = 0  # the first output goes at once
        while True:
            while not (entry.ends_queued or (entry.queue and entry.queued_tokens >= wake_at)):
                entry.wake_at = wake_at
                entry.waiter = asyncio.get_running_loop().create_future()
                try:
                    await entry.waiter
                finally:
                    entry.waiter = None
            items = list(entry.queue)
            entry.queue.clear()
            entry.queued_tokens, entry.ends_queued, wake_at = 0, False, interval
            deltas: list[TokenDelta] = []
            for item in items:
                if isinstance(item, TokenDelta):
                    deltas.append(item)
                    if item.finish_reason is None:
                        continue
                if deltas:
                    out = from_deltas(deltas, entry.prompt_token_ids)
                    deltas = []
                    yield out
                    if out.finished:
                        return
                assert isinstance(item, _RpcDone)
                if item.error is not None:
                    raise item.error
                # `tries` broke its contract: it returned before the final delta was handed on
                raise RuntimeError(f"{request_id}: its tries returned before its final delta (await them via watch)")
            if deltas:
                yield from_deltas(deltas, entry.prompt_token_ids)

    async def watch(self, request_id: str, call: Awaitable[Any]) -> None:
        """Run one try's worker call and return once the try delivered every token:
        the call returned and the final delta was handed on. The one place a try's
        end is decided: it raises the call's error; StreamLostError when the try's
        stream broke (a batch from one of its workers went missing: its held deltas
        may never come) or its final delta did not follow the call's return within
        `final_grace_s`; TimeoutError once the request's deadline passed (a try
        never outlives its request: this is the request's one deadline timer)."""
        entry = self._open[request_id]
        life = entry.life
        rpc = asyncio.ensure_future(call)
        broken = asyncio.ensure_future(entry.broken.wait())
        try:
            await asyncio.wait({rpc, broken}, timeout=life.remaining(), return_when=asyncio.FIRST_COMPLETED)
            if broken.done() and not rpc.done() and entry.finished.is_set():
                # Broken after its final delta was handed on: nothing was lost, the try is over
                # and its call returns in a moment. Moving it would run it again for no one.
                await asyncio.wait({rpc}, timeout=life.remaining())
            if entry.finished.is_set():
                # Every token was handed on: the try delivered, whatever its call says (a worker
                # that died, or was given up, just after its final delta). A next try would
                # run for a request that is over, and nothing would stop it.
                if rpc.done() and not rpc.cancelled():
                    rpc.exception()  # seen
                return
            if rpc.done():
                rpc.result()  # its own outcome first, even if the stream broke meanwhile
            elif broken.done() and not entry.finished.is_set():
                raise StreamLostError(f"{request_id}: a batch of its tokens was lost on the way")
            else:
                raise TimeoutError(f"request {request_id} passed its deadline")
            # The worker is done: its last delta is at most a moment behind (but not past the deadline).
            grace = min(self.final_grace_s, life.remaining())
            finished = asyncio.ensure_future(entry.finished.wait())
            try:
                await asyncio.wait({finished, broken}, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished.cancel()
            if entry.finished.is_set():
                return
            if broken.done() or grace >= self.final_grace_s:
                raise StreamLostError(f"{request_id}: the worker finished but its last tokens never arrived")
            raise TimeoutError(f"request {request_id} passed its deadline")
        finally:
            for task in (rpc, broken):
                if not task.done():
                    task.cancel()

    def finished(self, request_id: str) -> asyncio.Event:
        """Set once the request's final delta was handed on (it must be `open`): a try
        started on a worker's inbox is over then (cluster/worker_channel.py)."""
        return self._open[request_id].finished

    def next_attempt(self, request_id: str) -> Retry:
        """Give up on the request's current try (its worker died): from now on only
        deltas of the next try are taken (late ones of the old try are dropped, as
        are any it sent out of order). The answer says where the next try starts."""
        entry = self._open[request_id]
        entry.attempt += 1
        entry.held.clear()
        entry.senders.clear()
        entry.gaps_seen = self.num_gaps
        entry.broken.clear()
        entry.diverged = False
        resume = None
        if entry.token_ids:
            resume = Resume(tuple(entry.token_ids), entry.chars, entry.cumulative_logprob)
        return Retry(entry.attempt, resume, entry.life.remaining())

    def fail_all(self, error: Callable[[], BaseException]) -> int:
        """End every open request's stream with `error()`, after the deltas already here (a
        stop's last act: each reader raises it, its request's exit aborts it on its workers);
        how many. Requests opened later are not affected."""
        for entry in self._open.values():
            _put(entry, _RpcDone(error()))
        return len(self._open)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in self._fds:
            self._loop.remove_reader(fd)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    def _drain_monitor(self) -> None:
        """The monitor socket's events (each a dropped connection), drained as `_drain` drains."""
        while not self._closed and readable(self._monitor):
            self._monitor.recv_multipart(zmq.NOBLOCK)
            self.num_dropped += 1

    def _drain(self) -> None:
        """Take every message queued on the socket (workers/zmq_drain.py)."""
        drain(self._loop, self._sock_or_none, self._take, "token stream")

    def _sock_or_none(self) -> zmq.Socket[bytes] | None:
        return None if self._closed else self._sock

    def _take(self, parts: list[bytes]) -> None:
        if len(parts) != 2 or not auth.token_check(self._secret, self.address, parts[0], parts[1]):
            self.num_forged += 1
            if self.num_forged & (self.num_forged - 1) == 0:  # 1, 2, 4, ...: a flood does not flood the log
                log.warning("token stream: dropped a message whose MAC does not check (%d so far): a peer "
                            "without the cluster secret, or another one", self.num_forged)
            return
        try:
            batch = decode_token_batch(parts[1])  # decode_as(..., TokenDeltaBatch), fast
        except ValueError as e:
            self.num_rejected += 1
            log.warning("token stream: dropped a bad message: %s", e)
            return
        if not self._check_sequence(batch):
            return
        for d in batch.deltas:
            entry = self._open.get(d.request_id)
            if entry is not None:  # else: late deltas of a request that ended here
                if d.attempt == entry.attempt:
                    entry.senders.add(batch.worker_id)
                self._accept(entry, d)

    def _check_sequence(self, batch: TokenDeltaBatch) -> bool:
        """Whether to take the batch. Batches of one publisher come numbered from 0
        and in order (one connection each); a number already seen is a replay,
        refused. A missing number means lost deltas of requests we cannot name, so
        every try that publisher sends to is broken (they move on from what was
        handed on; nothing short is passed off as complete)."""
        wid = batch.worker_id
        expected = self._next_seq.get(wid, 0)
        if batch.seq < expected:
            self.num_replayed += 1
            log.warning("token stream: refused batch %d from %s again (replayed)", batch.seq, wid)
            return False
        self._next_seq[wid] = batch.seq + 1
        if batch.seq == expected:
            return True
        self.num_gaps += 1
        log.warning("token stream: batches %d..%d from %s are missing; its requests move on",
                    expected, batch.seq - 1, wid)
        for entry in self._open.values():
            # A try that sent from `wid` before, or that holds deltas waiting for an earlier one:
            # what it waits for may have been in the lost batches (the first delta a worker sends
            # a try, as a prefill worker's one first token, names no sender before it is lost).
            # A try whose final delta was handed on has lost nothing.
            if not entry.finished.is_set() and (wid in entry.senders or entry.held):
                entry.broken.set()
        return True

    def _accept(self, entry: _Open, d: TokenDelta) -> None:
        """Hand `d` on in offset order: one that overtook an earlier delta (another
        worker's) waits for it; a repeat of tokens already handed on is dropped, as
        is a delta of a try given up on or of one that diverged."""
        if d.attempt != entry.attempt or entry.diverged:
            self.num_stale += 1
            return
        if d.offset > entry.next_offset:
            self.num_out_of_order += 1
            entry.held.append(d)
            if self.num_gaps != entry.gaps_seen:
                # A batch went missing since this try began: the delta this one waits for may
                # have been in it, and would never come (`_check_sequence`).
                entry.broken.set()
            return
        if d.offset < entry.next_offset:
            self._repeat(entry, d)
            return
        self._pass(entry, d)
        while True:  # the held deltas this one was waiting for, in the order they came
            nxt = next((i for i, h in enumerate(entry.held) if h.offset == entry.next_offset), None)
            if nxt is None:
                return
            self._pass(entry, entry.held.pop(nxt))

    def _repeat(self, entry: _Open, d: TokenDelta) -> None:
        """Tokens handed on already, sent again: a worker recomputed them (a prefill worker
        published the first token, then died or lost its transfer, and the decode worker
        prefilled the prompt itself). The same tokens are dropped; others (a fresh draw
        of an unseeded sample) or more than were handed on would make the answer
        inconsistent, so the try breaks and the request resumes, elsewhere, from what
        the client has."""
        end = d.offset + len(d.token_ids)
        if end <= entry.next_offset and list(d.token_ids) == entry.token_ids[d.offset:end]:
            log.info("token stream: %s sent tokens %d.. again; dropped", d.request_id, d.offset)
            return
        self.num_diverged += 1
        entry.diverged = True
        log.warning("token stream: %s sent tokens %d.. again, and they differ from those handed on; "
                    "its try breaks", d.request_id, d.offset)
        entry.broken.set()

    @staticmethod
    def _pass(entry: _Open, d: TokenDelta) -> None:
        _put(entry, d)
        if d.finish_reason is not None:
            entry.finished.set()
        entry.next_offset += len(d.token_ids)
        entry.token_ids += d.token_ids
        entry.chars += len(d.text)
        if d.cumulative_logprob is not None:
            entry.cumulative_logprob = d.cumulative_logprob


def _put(entry: _Open, item: TokenDelta | _RpcDone) -> None:
    """Queue `item` for the entry's reader, and wake the reader if it now has what it waits for."""
    entry.queue.append(item)
    if isinstance(item, TokenDelta) and item.finish_reason is None:
        entry.queued_tokens += len(item.token_ids)
    else:
        entry.ends_queued = True
    w = entry.waiter
    if w is not None and not w.done() and (entry.ends_queued or entry.queued_tokens >= entry.wake_at):
        w.set_result(None)
