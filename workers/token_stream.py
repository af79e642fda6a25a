"""Token deltas from workers to the gateway: one ZeroMQ message per engine step.

Per-token RPCs cost more than the model on small batches: a Ray streaming item
costs the worker and the caller a sizeable share of a small decode step's time
(docs/performance.md, "Where the CPU goes per token"). So the worker's engine
thread buffers the DELTA outputs of a step and sends them as one
`TokenDeltaBatch` (typed msgpack, no pickle) per gateway; the gateway's
collector (cluster/token_collector.py) hands each delta to its request's queue.

The control path is apart: the gateway starts a request with a message to the
worker's inbox, and hears of its failure, or the worker's death, on one
long-polling call per worker (cluster/worker_inbox.py). A request is done when
its final delta arrives here.

Every token of a request comes this way, the first included, though not always
from one worker: after a handoff the prefill worker sends the first token and
the decode worker the rest. Each delta carries its offset in the request's
output, and the collector hands them on in that order.

    worker (engine thread): this module       gateway (asyncio): cluster/token_collector.py
    TokenStreamPublisher.add(addr, out) ...   TokenStreamCollector.consume(rid, tries)
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

import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import zmq

from pdserve.workers.link_monitor import SMALL_FRAME_BYTES, LinkMonitor, apply_heartbeats, apply_limits
from pdserve.workers.messages import (
    MAX_MESSAGE_BYTES,
    TokenDelta,
    TokenLogprobs,
    encode_token_deltas,
)
from pdserve.workers.outputs import CompletionOutput, RequestOutput
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


def from_deltas(ds: Sequence[TokenDelta], prompt_token_ids: list[int]) -> RequestOutput:
    """One DELTA output for consecutive deltas of one request, built once: what
    `merge_deltas` of their `from_delta`s makes. Why: a gateway that fell behind a
    stream takes every delta queued for it at once, and building (then merging) an
    output per token was most of what a token cost it there (docs/performance.md,
    "The front door")."""
    if len(ds) == 1:
        return from_delta(ds[0], prompt_token_ids)
    last = ds[-1]
    logprobs: list[dict[int, float]] | None = None
    if any(d.logprobs is not None for d in ds):
        logprobs = [dict(zip(e.token_ids, e.logprobs)) for d in ds for e in d.logprobs or ()]
    prompt_logprobs: list[dict[int, float] | None] | None = None
    if any(d.prompt_logprobs is not None for d in ds):
        prompt_logprobs = [dict(zip(e.token_ids, e.logprobs)) if e.token_ids else None
                           for d in ds for e in d.prompt_logprobs or ()]
    stop = last.stop_token if last.stop_token is not None else last.stop_string
    c = CompletionOutput(0, "".join(d.text for d in ds), [t for d in ds for t in d.token_ids],
                         last.cumulative_logprob, logprobs, last.finish_reason, stop)
    metrics = {} if last.queue_time_s is None else {"queue_time_s": last.queue_time_s}
    return RequestOutput(last.request_id, None, prompt_token_ids, [c], last.finish_reason is not None,
                         last.num_cached_tokens, metrics, prompt_logprobs)


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
            batches, too_big = _split(self.worker_id, rows, len(body))
            for row in too_big:
                log.error("token delta of %s is over the %d-byte message limit even alone; dropping the request",
                          row[0], MAX_MESSAGE_BYTES)
            lost += [row[0] for row in too_big]
            for batch in batches:
                seq = self._seq.get(address, 0)
                self._seq[address] = seq + 1
                lost += self._send(address, encode_token_deltas(self.worker_id, seq, batch), [r[0] for r in batch])
        return lost

    def _send(self, address: str, body: bytes, request_ids: list[str]) -> list[str]:
        """Sign and send one encoded batch; the ids it carried if the gateway is too far behind."""
        try:
            self._socket(address).send_multipart([auth.token_tag(self._secret, address, body), body], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("token stream to %s is %d batches behind; dropping its requests", address, SEND_HWM)
            return request_ids
        except zmq.ZMQError as e:  # an address ZeroMQ will not connect to: its requests, not the engine
            log.error("token stream to %s: %s; dropping its requests", address, e)
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
            # The monitor before the connect: a handshake that finished before it existed
            # would never be reported, and a live gateway be taken for gone after the grace.
            monitor = LinkMonitor(sock)
            try:
                sock.connect(address)
            except zmq.ZMQError:  # an address ZeroMQ refuses leaves nothing registered
                monitor.close()
                sock.close(linger=0)
                raise
            self._monitors[address] = monitor
            self._sockets[address] = sock
        return sock


_ROW = {name: i for i, name in enumerate(_WIRE_FIELDS)}


def _size(worker_id: str, rows: list[list[Any]]) -> int:
    return len(encode_token_deltas(worker_id, 0, rows))


def _split(worker_id: str, rows: list[list[Any]],
           total: int | None = None) -> tuple[list[list[list[Any]]], list[list[Any]]]:
    """The deltas (`wire_delta` rows) in order, as batches that each encode under
    MESSAGE_BUDGET, and the deltas that cannot (nothing to split but still too big). A
    delta whose prompt_logprobs make it too big becomes several: pieces with no tokens
    that carry consecutive slices of them, then the delta with the last slice (the
    gateway concatenates them). On the wire rows, not checked records: this runs on the
    engine thread, and building a record per prompt token stalled every request on the
    worker (~0.16 s for 8,000 prompt tokens with 20 logprobs each; ~0.03 s now). `total`:
    the size of all the rows as one message, where the caller has it."""
    total = _size(worker_id, rows) if total is None else total
    if total <= MESSAGE_BUDGET:
        return [rows], []
    pieces: list[tuple[list[Any], int]] = []
    too_big: list[list[Any]] = []
    for row in rows:
        size = total if len(rows) == 1 else _size(worker_id, [row])
        if size <= MESSAGE_BUDGET:
            pieces.append((row, size))
            continue
        entries = row[_ROW["prompt_logprobs"]] or []
        bare = _size(worker_id, [_with(row, prompt_logprobs=None)])
        per_entry = max(1.0, (size - bare) / max(1, len(entries)))
        step = int((MESSAGE_BUDGET - bare) / per_entry * 0.9)
        if not entries or step < 1:
            too_big.append(row)
            continue
        starts = list(range(0, len(entries), step))
        for i in starts[:-1]:
            piece = _with(row, token_ids=(), text="", finish_reason=None, stop_token=None, stop_string=None,
                          logprobs=[] if row[_ROW["logprobs"]] is not None else None,
                          prompt_logprobs=entries[i : i + step])
            pieces.append((piece, MESSAGE_BUDGET))  # (~0.9 of it, by `step`): a message of its own
        last = _with(row, prompt_logprobs=entries[starts[-1] :])
        pieces.append((last, _size(worker_id, [last])))
    batches: list[list[list[Any]]] = []
    used = MESSAGE_BUDGET + 1
    for piece, size in pieces:
        if used + size > MESSAGE_BUDGET:
            batches.append([])
            used = 0
        batches[-1].append(piece)
        used += size
    return batches, too_big


def _with(row: list[Any], **fields: Any) -> list[Any]:
    """A copy of the wire row with `fields` replaced."""
    out = list(row)
    for name, value in fields.items():
        out[_ROW[name]] = value
    return out


class StreamLostError(RuntimeError):
    """Tokens of the request were lost on their way: its final delta never came, or
    a batch of its worker's deltas is missing (the request moves to another try)."""
