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

# One file (over 450 lines): each message next to the codec that checks it; construction runs the same checks.

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgpack

from pdserve.workers.kv.event_log import EventCursor, EventSlice
from pdserve.workers.kv.events import KVEvent, KVEventKind

# Control messages are small; a bigger one is garbage or an attack, and
# rejecting it early keeps msgpack from allocating for it.
MAX_MESSAGE_BYTES = 1 << 20
_UINT64_MAX = (1 << 64) - 1


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
        _check_fields(self)
        supported, version = _version_of(type(self)), self.version
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
        _require(self.credits > 0, f"KVCreditGrant.credits: must be > 0, got {self.credits}")


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
        _require(self.num_blocks == len(self.dst_block_ids),
                 f"{name}.num_blocks: {self.num_blocks} != len(dst_block_ids) {len(self.dst_block_ids)}")
        _require(self.seq >= 0 and self.layer >= 0 and self.transfer_id >= 0,
                 f"{name}: seq, layer and transfer_id must be >= 0")
        _require(all(b >= 0 for b in self.dst_block_ids), f"{name}.dst_block_ids: must be >= 0")
        bits = 32 if self.checksum_kind is ChecksumKind.CRC32 else 64
        _require(0 <= self.checksum < 1 << bits, f"{name}.checksum: not a {bits}-bit value: {self.checksum}")
        _require(len(self.block_shape) == 3 and all(d > 0 for d in self.block_shape),
                 f"{name}.block_shape: expected 3 positive dims, got {self.block_shape}")
        _require(not (self.is_last and self.num_blocks), f"{name}: the end marker (is_last) carries no blocks")


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
        _require(self.credits >= 0, f"KVTransferAck.credits: must be >= 0, got {self.credits}")
        _require((self.state is TransferState.FAILED) == (self.reason is not None),
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
        _require(0 <= self.first_seq <= self.next_seq, f"KVEventBatch: seqs {self.first_seq}..{self.next_seq}")
        if self.snapshot:
            _require(self.first_seq == self.next_seq and all(e.kind is KVEventKind.STORED for e in self.events),
                     "KVEventBatch: a snapshot is STORED events at one seq")
        else:
            _require(self.next_seq - self.first_seq == len(self.events),
                     f"KVEventBatch: {len(self.events)} events for seqs {self.first_seq}..{self.next_seq}")

    @property
    def cursor(self) -> EventCursor:
        """Where the reader stands once it applied this batch (its next `load(since=...)`)."""
        return EventCursor(self.log_id, self.next_seq)

    @classmethod
    def of(cls, worker_id: str, read: EventSlice) -> KVEventBatch:
        return cls(worker_id=worker_id, log_id=read.log_id, first_seq=read.first_seq, next_seq=read.next_seq,
                   snapshot=read.snapshot, events=read.events)


class Record:
    """A typed value nested inside a message (a frozen dataclass, checked like a
    message's fields); on the wire, the array of its field values in order."""

    def __post_init__(self) -> None:
        _check_fields(self)


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
    body = {f.name: _to_wire(getattr(msg, f.name)) for f in _fields(type(msg)) if f.name != "version"}
    return _pack(type(msg), body)


def _pack(cls: type[Message], body: dict[str, Any]) -> bytes:
    """`[type, version, fields]` as msgpack; ValueError for what msgpack cannot write."""
    try:
        data: bytes = msgpack.packb([int(cls.TYPE), _version_of(cls), body], use_bin_type=True)
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
    supported = _version_of(cls)
    if type(version) is not int or version != supported:
        raise ValueError(f"decode {cls.__name__}: version {version!r} is not supported (this code speaks {supported})")
    if not isinstance(body, dict):
        raise ValueError(f"decode {cls.__name__}: fields must be a map")
    expected = {f.name for f in _fields(cls)} - {"version"}
    if missing := expected - body.keys():
        raise ValueError(f"decode {cls.__name__}: missing fields {sorted(missing)}")
    if extra := body.keys() - expected:
        raise ValueError(f"decode {cls.__name__}: unknown fields {sorted(extra)}")
    hints = _hints(cls)
    values = {name: _from_wire(f"{cls.__name__}.{name}", hints[name], body[name]) for name in expected}
    build: typing.Callable[..., Message] = cls  # a registered dataclass: its fields are the keywords
    return build(**values, version=version)


def decode_as(data: bytes | bytearray | memoryview, cls: type[M]) -> M:
    """`decode`, and a `ValueError` unless the message is a `cls`."""
    msg = decode(data)
    if not isinstance(msg, cls):
        raise ValueError(f"decode: expected {cls.__name__}, got {type(msg).__name__}")
    return msg


# -- field types -------------------------------------------------------------------

T = TypeVar("T")


def _per_class(fn: typing.Callable[[type], T]) -> typing.Callable[[type], T]:
    """`functools.cache` for a function of a class (typed: mypy does not take classes as Hashable)."""
    cache: dict[type, T] = {}

    def cached(cls: type) -> T:
        if cls not in cache:
            cache[cls] = fn(cls)
        return cache[cls]

    return cached


@_per_class
def _fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    return dataclasses.fields(cls)


@_per_class
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@_per_class
def _field_specs(cls: type) -> tuple[tuple[str, Any, str], ...]:
    """(name, type hint, name for errors) of each field: computed once per class, used per message."""
    hints = _hints(cls)
    return tuple((f.name, hints[f.name], f"{cls.__name__}.{f.name}") for f in _fields(cls))


@_per_class
def _version_of(cls: type) -> int:
    (version,) = (f.default for f in _fields(cls) if f.name == "version")
    return int(version)  # type: ignore[arg-type]


def _check_fields(obj: Any) -> None:
    """Check every field of a message or record against its type hint (lists become tuples, ...)."""
    for name, ok, hint, where in _field_checks(type(obj)):
        value = getattr(obj, name)
        if ok(value):  # the common case: already the declared type, nothing to convert
            continue
        checked = _check(where, hint, value)
        if checked is not value:
            object.__setattr__(obj, name, checked)


# Fast field checks. Why: a token delta has 14 fields and the gateway builds one per token per
# request; `_check`'s generic walk (typing.get_origin per field, per value) was most of a
# TokenDeltaBatch's decode time. Each predicate is True only where `_check` would return the value
# unchanged; anything else (a list to convert, an int for a float, a bad value) goes to `_check`.
_Ok = typing.Callable[[Any], bool]


def _ok_for(hint: Any) -> _Ok:
    if hint is int:
        return lambda v: type(v) is int and _INT64_MIN <= v <= _UINT64_MAX
    if hint in (str, bool, float):
        return lambda v: type(v) is hint
    if isinstance(hint, type) and issubclass(hint, (Record, enum.Enum)):
        return lambda v: type(v) is hint
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            inner = _ok_for(args[0])
            return lambda v: v is None or inner(v)
    if hint == _EVENT_TUPLE:  # a snapshot holds every cached block: ~10x faster than the full check
        return lambda v: type(v) is tuple and all(map(_event_ok, v))
    if origin is tuple:
        item = _ok_for(typing.get_args(hint)[0])
        return lambda v: type(v) is tuple and all(map(item, v))
    return lambda v: False  # the rest: always the full check


def _event_ok(e: Any) -> bool:
    """A KVEvent as `_check_event` would return it unchanged."""
    return (type(e) is KVEvent and type(e.kind) is KVEventKind and type(e.block_hash) is int
            and 0 <= e.block_hash <= _UINT64_MAX
            and (e.parent_hash is None or (type(e.parent_hash) is int and 0 <= e.parent_hash <= _UINT64_MAX)))


@_per_class
def _field_checks(cls: type) -> tuple[tuple[str, _Ok, Any, str], ...]:
    return tuple((name, _ok_for(hint), hint, where) for name, hint, where in _field_specs(cls))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


_INT64_MIN = -(1 << 63)
_INT_TUPLE = tuple[int, ...]
_EVENT_TUPLE = tuple[KVEvent, ...]


def _check(where: str, hint: Any, value: Any) -> Any:
    """`value` if it is a `hint` (lists become tuples, enum values become members); else ValueError."""
    # Fast paths first: every header and ack goes through here.
    # `type(...) is`, not isinstance: a bool must not pass as an int, nor an IntEnum.
    if hint is int:
        if type(value) is int and _INT64_MIN <= value <= _UINT64_MAX:
            return value
    elif hint is str or hint is bool:
        if type(value) is hint:
            return value
    elif hint == _INT_TUPLE and type(value) in (tuple, list) and all(type(x) is int for x in value):
        if not value or (_INT64_MIN <= min(value) and max(value) <= _UINT64_MAX):
            return value if type(value) is tuple else tuple(value)
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(where, inner, value)
    if origin is tuple:
        inner, _ = typing.get_args(hint)  # tuple[X, ...]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a sequence, got {type(value).__name__}")
        items = tuple(_check(f"{where}[{i}]", inner, v) for i, v in enumerate(value))
        return value if isinstance(value, tuple) and all(a is b for a, b in zip(items, value)) else items
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        if isinstance(value, hint):
            return value
        try:
            return hint(value)
        except ValueError:
            raise ValueError(f"{where}: {value!r} is not one of {[m.value for m in hint]}") from None
    if hint is KVEvent:
        return _check_event(where, value)
    if isinstance(hint, type) and issubclass(hint, Record):
        if type(value) is not hint:
            raise ValueError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        return value  # checked when it was built
    if hint is float and type(value) is int:
        return float(value)
    # `type(...) is`, not isinstance: a bool must not pass as an int, nor an IntEnum.
    if hint is int and type(value) is int:
        raise ValueError(f"{where}: {value} does not fit in 64 bits")
    if hint in (bool, str, float) and type(value) is hint:
        return value
    raise ValueError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}")


def _check_event(where: str, value: Any) -> KVEvent:
    if not isinstance(value, KVEvent):
        raise ValueError(f"{where}: expected KVEvent, got {type(value).__name__}")
    kind = _check(f"{where}.kind", KVEventKind, value.kind)
    for name in ("block_hash", "parent_hash"):
        h = getattr(value, name)
        if not (h is None and name == "parent_hash") and not (type(h) is int and 0 <= h <= _UINT64_MAX):
            raise ValueError(f"{where}.{name}: expected a 64-bit unsigned hash, got {h!r}")
    return value if kind is value.kind else KVEvent(kind, value.block_hash, value.parent_hash)


_PLAIN = frozenset((str, int, float, bool, type(None), bytes))  # written by msgpack as they are


def _to_wire(value: Any) -> Any:
    if type(value) in _PLAIN:
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):  # msgpack writes tuples as arrays; convert only what msgpack cannot write
        return [_to_wire(v) for v in value] if value and isinstance(value[0], (enum.Enum, KVEvent, Record)) else value
    if isinstance(value, KVEvent):
        return [value.kind.value, value.block_hash, value.parent_hash]
    if isinstance(value, Record):
        return [_to_wire(getattr(value, name)) for name, _, _ in _field_specs(type(value))]
    return value


def _from_wire(where: str, hint: Any, value: Any) -> Any:
    """Wire shapes back to field shapes, where they differ (events, records); types are checked after."""
    read = _reader(hint)
    return value if read is None else read(where, value)


_Read = typing.Callable[[str, Any], Any]
_readers: dict[Any, _Read | None] = {}


def _reader(hint: Any) -> _Read | None:
    """The function that turns `hint`'s wire shape into its field shape, made once per hint
    (None: the wire shape is the field shape). Per message only the fields that need it are
    touched (a token delta's records), without walking every hint again."""
    if hint not in _readers:
        _readers[hint] = _make_reader(hint)
    return _readers[hint]


def _make_reader(hint: Any) -> _Read | None:
    if hint == _EVENT_TUPLE:
        def events(where: str, value: Any) -> Any:
            if not isinstance(value, list):
                return value
            return [_read_event(f"{where}[{i}]", v) for i, v in enumerate(value)]
        return events
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        read = _reader(inner)
        return None if read is None else (lambda where, value: None if value is None else read(where, value))
    if origin is tuple:
        inner = typing.get_args(hint)[0]
        if not (isinstance(inner, type) and issubclass(inner, Record) or typing.get_origin(inner) is not None):
            return lambda where, value: tuple(value) if type(value) is list else value  # checked as a tuple
        item = _reader(inner)

        def items(where: str, value: Any) -> Any:
            if not isinstance(value, list) or item is None:
                return value
            return tuple(item(f"{where}[{i}]", v) for i, v in enumerate(value))
        return items
    if isinstance(hint, type) and issubclass(hint, Record):
        specs = _field_specs(hint)
        reads = [(i, read, name) for i, (name, h, _) in enumerate(specs) if (read := _reader(h)) is not None]

        def record(where: str, value: Any) -> Any:
            if value is None:
                return None  # the field check says what is wrong
            if not (isinstance(value, list) and len(value) == len(specs)):
                raise ValueError(f"{where}: expected the {len(specs)} fields of {hint.__name__} as an array")
            for i, read, name in reads:  # only the fields whose wire shape differs
                value[i] = read(f"{where}.{name}", value[i])
            return hint(*value)
        return record
    if hint is KVEvent:
        return lambda where, value: None if value is None else _read_event(where, value)
    return None


def _read_event(where: str, value: Any) -> KVEvent:
    if not (isinstance(value, list) and len(value) == 3):
        raise ValueError(f"{where}: expected [kind, block_hash, parent_hash]")
    return KVEvent(_check(f"{where}.kind", KVEventKind, value[0]), value[1], value[2])
