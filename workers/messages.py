"""Every message that crosses a process boundary: typed, frozen, versioned, msgpack on the wire.

Wire format of one message: the msgpack array `[type, version, {field: value}]`.
`type` is a `MessageType` value, `version` the message class's version (the
default of its `version` field), and the map holds every other field by name,
enums as their values and tuples as arrays. `decode` checks all of it (known
type, the version this code speaks, exactly the declared fields, each of the
declared type) and raises `ValueError` naming what is wrong. Nothing here
unpickles or evaluates: a peer can only make us build one of the dataclasses
below, with checked fields.

Construction checks the same types, so a message that encodes is one that
decodes. Sequence fields are tuples (lists are accepted and converted), so every
message is immutable and hashable.

To add a message: a `MessageType` member, a frozen dataclass deriving `Message`
with `@_register`, fields typed with int / bool / str / float / enums /
`X | None` / `tuple[X, ...]`, and `version: int = 1` last. Bump the version
when the fields change: a peer on the old version gets a clear error, not a
silent misread.
"""

from __future__ import annotations

import enum
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgpack

from pdserve.workers.kv.event_log import EventCursor, EventSlice
from pdserve.workers.kv.events import KVEvent, KVEventKind
from pdserve.workers.wire_fields import (
    Record,
    check_fields,
    fields_of,
    from_wire,
    hints_of,
    require,
    to_wire,
    version_of,
)

# Control messages are small; a bigger one is garbage or an attack, and
# rejecting it early keeps msgpack from allocating for it.
MAX_MESSAGE_BYTES = 1 << 20


class MessageType(enum.IntEnum):
    KV_TRANSFER_HELLO = 1
    KV_CREDIT_GRANT = 2
    KV_TRANSFER_HEADER = 3
    KV_TRANSFER_ACK = 4
    KV_TRANSFER_ABORT = 5
    KV_EVENT_BATCH = 6
    TOKEN_DELTA_BATCH = 7
    KV_HELLO_REFUSAL = 8


class TransferState(str, enum.Enum):
    """Where one request's KV transfer stands, as its receiver sees it."""

    PENDING = "pending"  # registered; not every expected layer/block has arrived and been verified
    DONE = "done"  # every expected layer of every registered block is written and verified
    FAILED = "failed"  # terminal; the blocks hold nothing usable (see FailReason)


class FailReason(str, enum.Enum):
    CHECKSUM = "checksum"  # a frame's bytes did not match its header's checksum
    TIMEOUT = "timeout"  # a deadline passed (receiver wait, sender credit or finish)
    ABORTED = "aborted"  # one side called abort(); the detail says which and why
    PROTOCOL = "protocol"  # a malformed or inconsistent message (shape, dtype, blocks, sequence)
    UNKNOWN_REQUEST = "unknown_request"  # the receiver has no registration for this request
    CLOSED = "closed"  # the transport was closed while the transfer was pending
    INTERNAL = "internal"  # the receiver could not write into its cache (a device error)
    PEER_LOST = "peer_lost"  # the connection to the other side was lost (it died, hung, or the network failed)


class ChecksumKind(str, enum.Enum):
    """How a data message's frames are checksummed; the receiver picks one the sender offered."""

    CRC32 = "crc32"  # zlib: always there (the KV transfer benchmark in docs/performance.md has its speed)
    XXH3_64 = "xxh3_64"  # the `xxhash` package, where installed: ~10x faster
    # Not checksummed: only where the sender offers it and the receiver does not ask for one (the NCCL
    # transport's default, docs/cluster.md: a host checksum costs a device-to-host copy per message).
    NONE = "none"


M = TypeVar("M", bound="Message")
_REGISTRY: dict[MessageType, type[Message]] = {}


class Message:
    """Base of every message. Subclasses are frozen, keyword-only dataclasses."""

    TYPE: ClassVar[MessageType]
    version: int  # every message declares it, last, with its current version as the default

    def __post_init__(self) -> None:
        check_fields(self)
        supported, version = version_of(type(self)), self.version
        if version != supported:
            raise ValueError(
                f"{type(self).__name__}: version {version} is not supported (this code speaks {supported})")


def _register(msg_type: MessageType) -> typing.Callable[[type[M]], type[M]]:
    def wrap(cls: type[M]) -> type[M]:
        if msg_type in _REGISTRY:
            raise RuntimeError(f"message type {msg_type!r} registered twice")
        cls.TYPE = msg_type
        _REGISTRY[msg_type] = cls
        return cls

    return wrap


# -- the messages ------------------------------------------------------------------


@_register(MessageType.KV_TRANSFER_HELLO)
@dataclass(frozen=True, kw_only=True)
class KVTransferHello(Message):
    """Sender → receiver, once per connection: asks for the initial credit window."""

    sender_id: str  # for logs only; the transport identifies peers itself
    # ChecksumKind values the sender can compute, best first; strings, so that a kind
    # this receiver does not know yet is skipped rather than failing the hello.
    checksums: tuple[str, ...]
    # Fresh per connection (hex): with the grant's, it keys this connection's MACs
    # (workers/transfer/auth.py), so nothing recorded on another connection checks.
    nonce: str
    # The sender's model (workers/transfer/fingerprint.py; "" when unknown): KV of
    # another model is refused at the hello, not written as if it were this one's.
    fingerprint: str = ""
    version: int = 2


@_register(MessageType.KV_CREDIT_GRANT)
@dataclass(frozen=True, kw_only=True)
class KVCreditGrant(Message):
    """Receiver → sender, the answer to a hello: `credits` data messages may be in flight,
    checksummed with `checksum`."""

    credits: int
    checksum: ChecksumKind
    nonce: str  # the receiver's half of the connection's key (see KVTransferHello.nonce)
    version: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.credits > 0, f"KVCreditGrant.credits: must be > 0, got {self.credits}")


@_register(MessageType.KV_HELLO_REFUSAL)
@dataclass(frozen=True, kw_only=True)
class KVHelloRefusal(Message):
    """Receiver -> sender, instead of a grant: this sender may not send here, and why
    (another model; or a hello whose MAC did not check: then it is sent unauthenticated,
    as a hint for the operator, with `receiver_nonce` empty)."""

    nonce: str  # the refused hello's
    receiver_nonce: str  # keys its MAC with the hello's nonce, as a grant's would; "" when unauthenticated
    reason: str
    version: int = 1


@_register(MessageType.KV_TRANSFER_HEADER)
@dataclass(frozen=True, kw_only=True)
class KVTransferHeader(Message):
    """Sender → receiver: the first frame of a data message; K and V frames follow.

    A data message carries K then V of `num_blocks` blocks of one layer,
    contiguous, in the order of `dst_block_ids` (blocks in the receiver's cache).
    The end marker (`is_last`, sent by `finish`) carries no blocks and no frames;
    its `seq` is the number of data messages of the transfer before it.
    """

    request_id: str
    transfer_id: int  # the sender's attempt; the receiver binds a registration to the first it sees
    seq: int  # 0, 1, 2, ... per transfer: lets the receiver see a lost or replayed message
    layer: int
    dst_block_ids: tuple[int, ...]
    num_blocks: int
    dtype: str  # torch dtype name, e.g. "float16"; checked against the receiver's cache
    block_shape: tuple[int, ...]  # one block of K (or V): (block_size, num_kv_heads, head_dim)
    checksum_kind: ChecksumKind
    checksum: int  # of the K frame's bytes, continued over the V frame's
    is_last: bool = False
    version: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        name = "KVTransferHeader"
        require(self.num_blocks == len(self.dst_block_ids),
                 f"{name}.num_blocks: {self.num_blocks} != len(dst_block_ids) {len(self.dst_block_ids)}")
        require(self.seq >= 0 and self.layer >= 0 and self.transfer_id >= 0,
                 f"{name}: seq, layer and transfer_id must be >= 0")
        require(all(b >= 0 for b in self.dst_block_ids), f"{name}.dst_block_ids: must be >= 0")
        bits = 32 if self.checksum_kind is ChecksumKind.CRC32 else 64
        require(0 <= self.checksum < 1 << bits, f"{name}.checksum: not a {bits}-bit value: {self.checksum}")
        require(len(self.block_shape) == 3 and all(d > 0 for d in self.block_shape),
                 f"{name}.block_shape: expected 3 positive dims, got {self.block_shape}")
        require(not (self.is_last and self.num_blocks), f"{name}: the end marker (is_last) carries no blocks")


@_register(MessageType.KV_TRANSFER_ACK)
@dataclass(frozen=True, kw_only=True)
class KVTransferAck(Message):
    """Receiver → sender, one per data message or end marker consumed.

    Returns `credits` (normally 1) and reports the transfer's state, so a
    failure on the receiving leg reaches the sending one at its next call.
    """

    request_id: str
    transfer_id: int
    seq: int
    state: TransferState
    reason: FailReason | None = None
    detail: str = ""
    credits: int = 1
    version: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.credits >= 0, f"KVTransferAck.credits: must be >= 0, got {self.credits}")
        require((self.state is TransferState.FAILED) == (self.reason is not None),
                 "KVTransferAck: a reason goes with, and only with, state FAILED")


@_register(MessageType.KV_TRANSFER_ABORT)
@dataclass(frozen=True, kw_only=True)
class KVTransferAbort(Message):
    """Either direction: stop this transfer; the other side frees what it holds for it."""

    request_id: str
    transfer_id: int  # 0 when the sender of the abort never learned it
    reason: str  # free text for logs and the client's error
    version: int = 1


@_register(MessageType.KV_EVENT_BATCH)
@dataclass(frozen=True, kw_only=True)
class KVEventBatch(Message):
    """Worker → router: what entered and left a worker's prefix cache, in order, read
    from the worker's numbered event log (`pdserve.workers.kv.event_log`) from where
    the reader stood. Reading consumes nothing: every reader sees every event.

    Either the log's events [first_seq, next_seq), or (`snapshot`) every block the
    worker caches, as STORED events, at next_seq (first_seq == next_seq): the reader
    replaces what it knew of the worker with them. Either way it reads on from
    `cursor`. Events mirror `pdserve.workers.kv.events.KVEvent`; on the wire each is
    `[kind, block_hash, parent_hash or nil]`.
    """

    worker_id: str
    log_id: str  # which log the seqs count in ("": a worker that keeps none, and answers snapshots)
    first_seq: int
    next_seq: int
    snapshot: bool
    events: tuple[KVEvent, ...]
    version: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.first_seq <= self.next_seq, f"KVEventBatch: seqs {self.first_seq}..{self.next_seq}")
        if self.snapshot:
            require(self.first_seq == self.next_seq and all(e.kind is KVEventKind.STORED for e in self.events),
                     "KVEventBatch: a snapshot is STORED events at one seq")
        else:
            require(self.next_seq - self.first_seq == len(self.events),
                     f"KVEventBatch: {len(self.events)} events for seqs {self.first_seq}..{self.next_seq}")

    @property
    def cursor(self) -> EventCursor:
        """Where the reader stands once it applied this batch (its next `load(since=...)`)."""
        return EventCursor(self.log_id, self.next_seq)

    @classmethod
    def of(cls, worker_id: str, read: EventSlice) -> KVEventBatch:
        return cls(worker_id=worker_id, log_id=read.log_id, first_seq=read.first_seq, next_seq=read.next_seq,
                   snapshot=read.snapshot, events=read.events)


@dataclass(frozen=True)
class TokenLogprobs(Record):
    """One generated token's logprobs: the top-N candidates and the sampled token."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"TokenLogprobs: {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")


@dataclass(frozen=True)
class TokenDelta(Record):
    """What one request generated since its last delta (a DELTA RequestOutput)."""

    request_id: str
    # Output tokens of the request before this delta: its place in the request's
    # stream. One request's deltas may come from two workers (the prefill worker
    # sends the first token, the decode worker the rest): the gateway puts them
    # in this order, and sees a gap.
    offset: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    stop_token: int | None
    stop_string: str | None
    num_cached_tokens: int
    cumulative_logprob: float | None
    logprobs: tuple[TokenLogprobs, ...] | None
    # Seconds the request waited in its worker's scheduler queue before its
    # first step (RequestOutput.metrics["queue_time_s"]); None until scheduled.
    queue_time_s: float | None = None
    # SamplingParams.prompt_logprobs, in the request's first delta: one entry per
    # prompt token (the first token's, which has none, is empty).
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    # The try of the request it belongs to (ServeRequest.attempt): after a
    # migration the gateway takes only the new try's deltas.
    attempt: int = 0


@_register(MessageType.TOKEN_DELTA_BATCH)
@dataclass(frozen=True, kw_only=True)
class TokenDeltaBatch(Message):
    """Worker → gateway: the token deltas of one engine step for the requests
    this gateway sent, in one message (not one RPC per token). `seq` counts
    batches per (worker, gateway) so a gap is visible."""

    worker_id: str
    seq: int
    deltas: tuple[TokenDelta, ...]
    version: int = 5


# -- encode / decode ---------------------------------------------------------------


def encode(msg: Message) -> bytes:
    """msgpack bytes of `msg` (see the module docstring for the layout)."""
    if type(msg) not in _REGISTRY.values():
        raise ValueError(f"encode: {type(msg).__name__} is not a registered message")
    body = {f.name: to_wire(getattr(msg, f.name)) for f in fields_of(type(msg)) if f.name != "version"}
    return _pack(type(msg), body)


def _pack(cls: type[Message], body: dict[str, Any]) -> bytes:
    """`[type, version, fields]` as msgpack; ValueError for what msgpack cannot write."""
    try:
        data: bytes = msgpack.packb([int(cls.TYPE), version_of(cls), body], use_bin_type=True)
        return data
    except (OverflowError, TypeError, ValueError) as e:
        raise ValueError(f"encode {cls.__name__}: {e}") from e


def encode_token_deltas(worker_id: str, seq: int, rows: list[list[Any]]) -> bytes:
    """`encode(TokenDeltaBatch(worker_id=..., seq=..., deltas=...))` for deltas already in
    their wire form (token_stream.wire_delta), byte for byte. Why: the worker's engine
    thread sends one of these every step, and building a checked TokenDelta record per
    token, then walking it back to its wire form, cost ~16 us a token there (a tenth of a
    small model's decode step). The gateway still checks every field (`decode`): that is
    where a peer's bytes are met."""
    return _pack(TokenDeltaBatch, {"worker_id": worker_id, "seq": seq, "deltas": rows})


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message in `data`; `ValueError` for anything that is not exactly a known message."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"decode: {len(data)} bytes is over the {MAX_MESSAGE_BYTES}-byte message limit")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ValueError(f"decode: not a msgpack message ({type(e).__name__}: {e})") from e
    if not (isinstance(obj, list) and len(obj) == 3):
        raise ValueError("decode: expected [type, version, fields]")
    raw_type, version, body = obj
    if type(raw_type) is not int or raw_type not in _REGISTRY:
        raise ValueError(f"decode: unknown message type {raw_type!r}")
    cls = _REGISTRY[MessageType(raw_type)]
    supported = version_of(cls)
    if type(version) is not int or version != supported:
        raise ValueError(f"decode {cls.__name__}: version {version!r} is not supported (this code speaks {supported})")
    if not isinstance(body, dict):
        raise ValueError(f"decode {cls.__name__}: fields must be a map")
    expected = {f.name for f in fields_of(cls)} - {"version"}
    if missing := expected - body.keys():
        raise ValueError(f"decode {cls.__name__}: missing fields {sorted(missing)}")
    if extra := body.keys() - expected:
        raise ValueError(f"decode {cls.__name__}: unknown fields {sorted(extra)}")
    hints = hints_of(cls)
    values = {name: from_wire(f"{cls.__name__}.{name}", hints[name], body[name]) for name in expected}
    build: typing.Callable[..., Message] = cls  # a registered dataclass: its fields are the keywords
    return build(**values, version=version)


def decode_as(data: bytes | bytearray | memoryview, cls: type[M]) -> M:
    """`decode`, and a `ValueError` unless the message is a `cls`."""
    msg = decode(data)
    if not isinstance(msg, cls):
        raise ValueError(f"decode: expected {cls.__name__}, got {type(msg).__name__}")
    return msg
