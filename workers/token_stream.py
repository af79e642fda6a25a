"""Token deltas from workers to the gateway: one ZeroMQ message per engine step.

Per-token RPCs cost more than the model on small batches: a Ray streaming item
costs the worker and the caller a sizeable share of a small decode step's time
(docs/performance.md, "Where the CPU goes per token"). So the worker's engine
thread buffers the DELTA outputs of a step and sends them as one
`TokenDeltaBatch` (typed msgpack, no pickle) per gateway; the gateway's
collector hands each delta to its request's queue.

The control path stays on RPC: the gateway starts the request with a call that
returns when the request is over (or raises its error), which is also how a
dead worker is noticed. Deltas arrive here; the RPC's result only says "done".

Every token of a request comes this way, the first included, though not always
from one worker: after a handoff the prefill worker sends the first token and
the decode worker the rest. Each delta carries its offset in the request's
output, and the collector hands them on in that order.

    worker (engine thread)                    gateway (asyncio)
    TokenStreamPublisher.add(addr, out) ...   TokenStreamCollector.consume(rid, rpc)
    TokenStreamPublisher.flush()  --PUSH-->   PULL socket -> per-request queue

Authentication (workers/transfer/auth.py): each message is `[tag, batch]`, the
tag an HMAC-SHA256 under the cluster secret over the gateway's stream address
and the encoded batch (its publisher id and number included). The collector
drops, unread, a message whose tag does not check (`num_forged`), and one whose
number its publisher already used (`num_replayed`): whoever knows a request id
but not the secret cannot put a word into its answer, nor replay one that was
sent. The PULL socket refuses frames over the message limit (ZMQ_MAXMSGSIZE:
the connection is dropped, `num_dropped`) and queues a bounded number per
connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from pdserve.workers.handoff import Resume
from pdserve.workers.lifecycle import Exit, Lifecycle, RequestState
from pdserve.workers.link_monitor import SMALL_FRAME_BYTES, LinkMonitor, apply_heartbeats, apply_limits
from pdserve.workers.messages import (
    MAX_MESSAGE_BYTES,
    TokenDelta,
    TokenDeltaBatch,
    TokenLogprobs,
    decode_as,
    encode,
    encode_token_deltas,
)
from pdserve.workers.outputs import CompletionOutput, RequestOutput, merge_deltas
from pdserve.workers.transfer import auth
from pdserve.workers.transfer.auth import ClusterSecret

log = logging.getLogger(__name__)

# Step batches a gateway may fall behind by before the worker gives up on its
# requests (aborts them) rather than buffer without bound.
SEND_HWM = 4096
# What one message may take of the receiver's limit (it refuses bigger ones whole).
MESSAGE_BUDGET = MAX_MESSAGE_BYTES - 4096
# A gateway whose link has been down this long (never up, or lost and not back:
# heartbeats close a link to a dead or frozen one within seconds) is taken for
# gone, and the worker aborts its requests rather than compute for nobody.
GATEWAY_GONE_S = 10.0
# Messages the gateway's PULL queues per worker connection before it stops
# reading that connection (then the worker's SEND_HWM fills, and it gives up on
# that gateway's requests): bounded, so no peer can make the gateway hold more.
RECEIVE_HWM = 1000


# TokenDelta's fields in their wire order: `wire_delta` writes them in this order.
_WIRE_FIELDS = ("request_id", "offset", "token_ids", "text", "finish_reason", "stop_token", "stop_string",
                "num_cached_tokens", "cumulative_logprob", "logprobs", "queue_time_s", "prompt_logprobs", "attempt")
assert tuple(f.name for f in dataclasses.fields(TokenDelta)) == _WIRE_FIELDS, "TokenDelta changed: mend wire_delta"


def wire_delta(out: RequestOutput, offset: int, attempt: int = 0) -> list[Any]:
    """A DELTA output's TokenDelta in its wire form (the array of its fields `encode`
    writes), built straight from the output: the engine thread's per-token path (see
    messages.encode_token_deltas for why); `to_delta` is its checked record."""
    c = out.outputs[0]
    stop = c.stop_reason
    logprobs = None if c.logprobs is None else [[tuple(e), tuple(e.values())] for e in c.logprobs]
    prompt_logprobs = None if out.prompt_logprobs is None else [
        [tuple(e or ()), tuple((e or {}).values())] for e in out.prompt_logprobs]
    return [out.request_id, offset, tuple(c.token_ids), c.text, c.finish_reason,
            stop if isinstance(stop, int) else None, stop if isinstance(stop, str) else None,
            out.num_cached_tokens, c.cumulative_logprob, logprobs, out.metrics.get("queue_time_s"),
            prompt_logprobs, attempt]


def _delta_of(row: list[Any]) -> TokenDelta:
    """The record `row` (a `wire_delta`) stands for (checked as it is built)."""
    values = dict(zip(_WIRE_FIELDS, row, strict=True))
    for name in ("logprobs", "prompt_logprobs"):
        if values[name] is not None:
            values[name] = tuple(TokenLogprobs(tuple(ids), tuple(lps)) for ids, lps in values[name])
    return TokenDelta(**values)


def to_delta(out: RequestOutput, offset: int, attempt: int = 0) -> TokenDelta:
    """`out` (a DELTA output) as the wire record; `offset`: output tokens before it;
    `attempt`: the request's try (ServeRequest.attempt)."""
    return _delta_of(wire_delta(out, offset, attempt))


def from_delta(d: TokenDelta, prompt_token_ids: list[int]) -> RequestOutput:
    logprobs = None if d.logprobs is None else [dict(zip(e.token_ids, e.logprobs)) for e in d.logprobs]
    stop = d.stop_token if d.stop_token is not None else d.stop_string
    c = CompletionOutput(0, d.text, list(d.token_ids), d.cumulative_logprob, logprobs, d.finish_reason, stop)
    metrics = {} if d.queue_time_s is None else {"queue_time_s": d.queue_time_s}
    # Only the first prompt token has no entry: an empty record stands for its None.
    prompt_logprobs = None if d.prompt_logprobs is None else [
        dict(zip(e.token_ids, e.logprobs)) if e.token_ids else None for e in d.prompt_logprobs]
    return RequestOutput(d.request_id, None, prompt_token_ids, [c], d.finish_reason is not None, d.num_cached_tokens,
                         metrics, prompt_logprobs)


class TokenStreamPublisher:
    """Worker side. Used from one thread only (the engine thread): ZeroMQ
    sockets are not thread-safe. Signs with `secret` (None: `auth.default_secret()`,
    which a worker process sets from its constructor's argument)."""

    def __init__(self, worker_id: str, context: zmq.Context[zmq.Socket[bytes]] | None = None,
                 secret: ClusterSecret | None = None) -> None:
        # Batches are numbered per publisher, so each signs with an id of its own:
        # two workers of one name, or a worker restarted under its old name, are
        # told apart by the gateway's sequence check.
        self.worker_id = f"{worker_id}#{uuid.uuid4().hex[:8]}"
        self._ctx = context or zmq.Context.instance()
        self._secret = auth.resolve(secret)
        self._sockets: dict[str, zmq.Socket[bytes]] = {}
        self._monitors: dict[str, LinkMonitor] = {}
        self._pending: dict[str, list[list[Any]]] = {}  # per gateway, `wire_delta`s
        self._seq: dict[str, int] = {}

    def add(self, address: str, out: RequestOutput, offset: int, attempt: int = 0) -> None:
        """Buffer `out` (a DELTA output, `offset` output tokens into its request's
        try `attempt`) for `flush`."""
        self._pending.setdefault(address, []).append(wire_delta(out, offset, attempt))

    def flush(self) -> list[str]:
        """Send what `add` buffered, one message per gateway (more when one would
        pass the receiver's size limit: a long prompt's prompt_logprobs). Returns
        the request ids whose deltas could not be sent (the gateway is gone or far
        behind, or a delta too big even alone)."""
        lost: list[str] = []
        pending, self._pending = self._pending, {}
        for address, rows in pending.items():
            seq = self._seq.get(address, 0)
            body = encode_token_deltas(self.worker_id, seq, rows)
            if len(body) <= MESSAGE_BUDGET:  # a step's deltas: one message
                self._seq[address] = seq + 1
                lost += self._send(address, body, [row[0] for row in rows])
                continue
            batches, too_big = _split(self.worker_id, [_delta_of(row) for row in rows])
            for d in too_big:
                log.error("token delta of %s is over the %d-byte message limit even alone; dropping the request",
                          d.request_id, MAX_MESSAGE_BYTES)
            lost += [d.request_id for d in too_big]
            for batch in batches:
                seq = self._seq.get(address, 0)
                self._seq[address] = seq + 1
                body = encode(TokenDeltaBatch(worker_id=self.worker_id, seq=seq, deltas=tuple(batch)))
                lost += self._send(address, body, [d.request_id for d in batch])
        return lost

    def _send(self, address: str, body: bytes, request_ids: list[str]) -> list[str]:
        """Sign and send one encoded batch; the ids it carried if the gateway is too far behind."""
        try:
            self._socket(address).send_multipart([auth.token_tag(self._secret, address, body), body], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("token stream to %s is %d batches behind; dropping its requests", address, SEND_HWM)
            return request_ids
        return []

    def watch(self, address: str) -> None:
        """Connect to the gateway at `address` now (before any delta), so that one
        that is gone is noticed for requests that have sent nothing yet."""
        self._socket(address)

    def gone(self, grace_s: float = GATEWAY_GONE_S) -> list[str]:
        """The gateways whose link has been down for `grace_s` (never up, or lost
        and not back); their sockets are closed (a later `add` opens a new one)."""
        now = time.monotonic()
        lost: list[str] = []
        for address, monitor in list(self._monitors.items()):
            monitor.poll()
            if not monitor.connected and now - monitor.changed_at > grace_s:
                lost.append(address)
                self._drop(address)
        return lost

    def close(self) -> None:
        for address in list(self._sockets):
            self._drop(address)

    def _drop(self, address: str) -> None:
        self._monitors.pop(address).close()
        self._sockets.pop(address).close(linger=0)  # (its numbering goes on: the gateway may be back)

    def _socket(self, address: str) -> zmq.Socket[bytes]:
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            # It never takes a message; inbound there is only the ZMTP handshake and heartbeats.
            apply_limits(sock, max_frame_bytes=SMALL_FRAME_BYTES, sndhwm=SEND_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            apply_heartbeats(sock)
            self._monitors[address] = LinkMonitor(sock)
            sock.connect(address)
            self._sockets[address] = sock
        return sock


def _size(worker_id: str, deltas: list[TokenDelta]) -> int:
    return len(encode(TokenDeltaBatch(worker_id=worker_id, seq=0, deltas=tuple(deltas))))


def _split(worker_id: str, deltas: list[TokenDelta]) -> tuple[list[list[TokenDelta]], list[TokenDelta]]:
    """The deltas in order, as batches that each encode under MESSAGE_BUDGET, and
    the deltas that cannot (nothing to split but still too big). A delta whose
    prompt_logprobs make it too big becomes several: pieces with no tokens that
    carry consecutive slices of them, then the delta with the last slice (the
    gateway concatenates them)."""
    if _size(worker_id, deltas) <= MESSAGE_BUDGET:
        return [deltas], []
    pieces: list[tuple[TokenDelta, int]] = []
    too_big: list[TokenDelta] = []
    for d in deltas:
        size = _size(worker_id, [d])
        if size <= MESSAGE_BUDGET:
            pieces.append((d, size))
            continue
        entries = d.prompt_logprobs or ()
        bare = _size(worker_id, [dataclasses.replace(d, prompt_logprobs=None)])
        per_entry = max(1.0, (size - bare) / max(1, len(entries)))
        step = int((MESSAGE_BUDGET - bare) / per_entry * 0.9)
        if not entries or step < 1:
            too_big.append(d)
            continue
        starts = list(range(0, len(entries), step))
        for i in starts[:-1]:
            piece = dataclasses.replace(d, token_ids=(), text="", finish_reason=None, stop_token=None, stop_string=None,
                                        logprobs=() if d.logprobs is not None else None,
                                        prompt_logprobs=entries[i : i + step])
            pieces.append((piece, _size(worker_id, [piece])))
        last = dataclasses.replace(d, prompt_logprobs=entries[starts[-1] :])
        pieces.append((last, _size(worker_id, [last])))
    batches: list[list[TokenDelta]] = []
    used = MESSAGE_BUDGET + 1
    for piece, size in pieces:
        if used + size > MESSAGE_BUDGET:
            batches.append([])
            used = 0
        batches[-1].append(piece)
        used += size
    return batches, too_big


@dataclass(frozen=True)
class Retry:
    """Where a request's next try starts (`TokenStreamCollector.next_attempt`)."""

    attempt: int
    resume: Resume | None  # what the client already has (None: nothing yet, start over)
    remaining_s: float  # of the request's deadline


class StreamLostError(RuntimeError):
    """Tokens of the request were lost on their way: its final delta never came, or
    a batch of its worker's deltas is missing (the request moves to another try)."""


@dataclass(eq=False)
class _Open:
    prompt_token_ids: list[int]
    life: Lifecycle
    queue: asyncio.Queue[RequestOutput | _RpcDone | _Expired] = field(default_factory=asyncio.Queue)
    next_offset: int = 0  # output tokens handed on so far: the offset the next delta must have
    held: list[tuple[int, RequestOutput]] = field(default_factory=list)  # deltas that came early
    attempt: int = 0  # the try whose deltas are taken (ServeRequest.attempt)
    # What was handed on (what the client has, or will as it reads): where a migrated try resumes.
    token_ids: list[int] = field(default_factory=list)
    chars: int = 0
    cumulative_logprob: float | None = None
    senders: set[str] = field(default_factory=set)  # the workers that sent this try's deltas
    # Set when the current try can no longer be trusted to deliver every token (a
    # batch from one of its senders went missing), or when its final delta passed.
    broken: asyncio.Event = field(default_factory=asyncio.Event)
    diverged: bool = False  # the try re-sent handed-on tokens differently: nothing more of it is taken
    finished: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _RpcDone:
    error: BaseException | None


class _Expired:
    """Queued by a request's deadline timer."""


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
                 secret: ClusterSecret | None = None) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        self._secret = auth.resolve(secret)
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        apply_limits(self._sock, max_frame_bytes=MAX_MESSAGE_BYTES, rcvhwm=RECEIVE_HWM)
        apply_heartbeats(self._sock)  # a dead worker's connection is dropped, not kept for ever
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{bind_host}:{port}"
        self.final_grace_s = final_grace_s
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
        self._reader = asyncio.get_running_loop().create_task(self._read())
        self._watcher = asyncio.get_running_loop().create_task(self._watch_drops())

    def open(self, request_id: str, prompt_token_ids: list[int], timeout_s: float) -> Lifecycle:
        """Start collecting `request_id`'s deltas, before any worker can send one;
        returns its lifecycle here. `consume` reads them and closes it."""
        if request_id in self._open:
            raise ValueError(f"request_id: {request_id!r} is already streaming")
        life = Lifecycle.start(request_id, timeout_s)
        self._open[request_id] = _Open(prompt_token_ids, life)
        return life

    async def consume(self, request_id: str, start: Awaitable[Any]) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's DELTA outputs (it must be `open`), in order, until the
        final one. `start` is the RPC that runs the request on a worker (awaited
        here: its error is raised; its return means the final delta is on its way).
        However this ends, the request's lifecycle ends with it."""
        entry = self._open[request_id]
        life = entry.life
        rpc = asyncio.ensure_future(start)
        rpc.add_done_callback(lambda f: entry.queue.put_nowait(_RpcDone(None if f.cancelled() else f.exception())))
        life.move(RequestState.ROUTED)
        exit = Exit.ABORTED  # unless it ends below: the reader went away (client gone)
        try:
            async with contextlib.aclosing(self._ordered(request_id, entry)) as ordered:
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

    async def _ordered(self, request_id: str, entry: _Open) -> AsyncGenerator[RequestOutput, None]:
        """The entry's outputs until the final one (merged when the reader is behind).

        The deadline is one timer per request that queues `_Expired` behind whatever
        came before it, not a `wait_for` per delta (a task and a timer per token, a
        good part of the gateway's time per token under load)."""
        loop = asyncio.get_running_loop()
        done: _RpcDone | None = None
        pending: _RpcDone | _Expired | None = None  # met while merging: handled after that delta
        item: RequestOutput | _RpcDone | _Expired

        def arm(deadline: float) -> asyncio.TimerHandle:
            return loop.call_later(max(deadline - time.monotonic(), 0.0), entry.queue.put_nowait, _Expired())

        timer = arm(entry.life.deadline)
        try:
            while True:
                if pending is not None:
                    item, pending = pending, None
                else:
                    item = await entry.queue.get()
                if isinstance(item, RequestOutput):
                    # Behind? Everything queued goes out as one delta.
                    while not item.finished and not entry.queue.empty():
                        nxt = entry.queue.get_nowait()
                        if not isinstance(nxt, RequestOutput):
                            pending = nxt
                            break
                        item = merge_deltas(item, nxt)
                    yield item
                    if item.finished:
                        return
                elif isinstance(item, _Expired):
                    if done is not None:
                        raise StreamLostError(f"{request_id}: the worker finished but its last tokens never arrived")
                    raise TimeoutError(f"request {request_id} passed its deadline")
                else:
                    done = item
                    if done.error is not None:
                        raise done.error
                    # The worker is done: its last delta is at most a moment behind.
                    timer.cancel()
                    timer = arm(min(entry.life.deadline, time.monotonic() + self.final_grace_s))
        finally:
            timer.cancel()

    async def watch(self, request_id: str, call: Awaitable[Any]) -> None:
        """Run one try's worker call and return once the try delivered every token:
        the call returned and the final delta was handed on. Raises the call's error,
        or StreamLostError when the try's stream broke (a batch from one of its
        workers went missing: its held deltas may never come) or its final delta did
        not follow the call's return within `final_grace_s`."""
        entry = self._open[request_id]
        rpc = asyncio.ensure_future(call)
        broken = asyncio.ensure_future(entry.broken.wait())
        try:
            await asyncio.wait({rpc, broken}, return_when=asyncio.FIRST_COMPLETED)
            if not rpc.done():
                raise StreamLostError(f"{request_id}: a batch of its tokens was lost on the way")
            rpc.result()
            # The worker is done: its last delta is at most a moment behind.
            finished = asyncio.ensure_future(entry.finished.wait())
            try:
                await asyncio.wait({finished, broken}, timeout=self.final_grace_s,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished.cancel()
            if not entry.finished.is_set():
                raise StreamLostError(f"{request_id}: the worker finished but its last tokens never arrived")
        finally:
            for task in (rpc, broken):
                if not task.done():
                    task.cancel()

    def next_attempt(self, request_id: str) -> Retry:
        """Give up on the request's current try (its worker died): from now on only
        deltas of the next try are taken (late ones of the old try are dropped, as
        are any it sent out of order). The answer says where the next try starts."""
        entry = self._open[request_id]
        entry.attempt += 1
        entry.held.clear()
        entry.senders.clear()
        entry.broken.clear()
        entry.diverged = False
        resume = None
        if entry.token_ids:
            resume = Resume(tuple(entry.token_ids), entry.chars, entry.cumulative_logprob)
        return Retry(entry.attempt, resume, entry.life.remaining())

    async def close(self) -> None:
        for task in (self._reader, self._watcher):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    async def _watch_drops(self) -> None:
        while True:
            await self._monitor.recv_multipart()
            self.num_dropped += 1

    async def _read(self) -> None:
        while True:
            parts = await self._sock.recv_multipart(copy=True)
            if len(parts) != 2 or not auth.token_check(self._secret, self.address, parts[0], parts[1]):
                self.num_forged += 1
                if self.num_forged & (self.num_forged - 1) == 0:  # 1, 2, 4, ...: a flood does not flood the log
                    log.warning("token stream: dropped a message whose MAC does not check (%d so far): a peer "
                                "without the cluster secret, or another one", self.num_forged)
                continue
            try:
                batch = decode_as(parts[1], TokenDeltaBatch)
            except ValueError as e:
                self.num_rejected += 1
                log.warning("token stream: dropped a bad message: %s", e)
                continue
            if not self._check_sequence(batch):
                continue
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
            if wid in entry.senders:
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
            entry.held.append((d.offset, from_delta(d, entry.prompt_token_ids)))
            return
        if d.offset < entry.next_offset:
            self._repeat(entry, d)
            return
        self._pass(entry, from_delta(d, entry.prompt_token_ids))
        while True:  # the held deltas this one was waiting for, in the order they came
            nxt = next((i for i, (offset, _) in enumerate(entry.held) if offset == entry.next_offset), None)
            if nxt is None:
                return
            self._pass(entry, entry.held.pop(nxt)[1])

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
    def _pass(entry: _Open, out: RequestOutput) -> None:
        entry.queue.put_nowait(out)
        if out.finished:
            entry.finished.set()
        c = out.outputs[0]
        entry.next_offset += len(c.token_ids)
        entry.token_ids += c.token_ids
        entry.chars += len(c.text)
        if c.cumulative_logprob is not None:
            entry.cumulative_logprob = c.cumulative_logprob
