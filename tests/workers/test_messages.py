"""Typed messages on the wire: every message type round-trips, and `decode` rejects whatever is not exactly
a known message (never unpickling or evaluating anything)."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import msgpack
import pytest
from kv_links import Exploit, header

from pdserve.workers.kv.events import KVEvent, KVEventKind
from pdserve.workers.messages import (
    ChecksumKind,
    FailReason,
    KVCreditGrant,
    KVEventBatch,
    KVHelloRefusal,
    KVTransferAbort,
    KVTransferAck,
    KVTransferHello,
    Message,
    MessageType,
    TokenDelta,
    TokenDeltaBatch,
    TokenLogprobs,
    TransferState,
    decode,
    encode,
)

EXAMPLES: list[Message] = [
    KVTransferHello(sender_id="prefill-0", checksums=("xxh3_64", "crc32"), nonce="ab" * 16, fingerprint="f00d"),
    KVHelloRefusal(nonce="ab" * 16, receiver_nonce="", reason="another model"),
    KVCreditGrant(credits=8, checksum=ChecksumKind.CRC32, nonce="cd" * 16),
    header(),
    header(checksum_kind=ChecksumKind.XXH3_64, checksum=(1 << 64) - 1),
    header(dst_block_ids=(), num_blocks=0, seq=32, is_last=True),
    KVTransferAck(request_id="r1", transfer_id=7, seq=3, state=TransferState.PENDING),
    KVTransferAck(request_id="r1", transfer_id=7, seq=3, state=TransferState.FAILED, reason=FailReason.CHECKSUM,
                  detail="crc32 mismatch"),
    KVTransferAbort(request_id="r1", transfer_id=7, reason="client went away"),
    KVEventBatch(worker_id="prefill-0", log_id="ab12", first_seq=4, next_seq=6, snapshot=False, events=(
        KVEvent(KVEventKind.STORED, (1 << 64) - 1, 0), KVEvent(KVEventKind.REMOVED, 12345))),
    KVEventBatch(worker_id="prefill-0", log_id="ab12", first_seq=9, next_seq=9, snapshot=True, events=(
        KVEvent(KVEventKind.STORED, 7, None),)),
    TokenDeltaBatch(worker_id="decode-0", seq=9, deltas=(
        TokenDelta("r1", 0, (5, 6), "ab", None, None, None, 16, None, None),
        TokenDelta("r2", 4, (7,), "c", "stop", 7, None, 0, -0.25, (TokenLogprobs((7, 3), (-0.25, -1.5)),)))),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_message_round_trips(msg: Message) -> None:
    back = decode(encode(msg))
    assert back == msg and type(back) is type(msg)


def test_every_message_type_has_an_example() -> None:
    assert {m.TYPE for m in EXAMPLES} == set(MessageType)


def test_lists_become_tuples_so_messages_are_immutable_and_hashable() -> None:
    h = header(dst_block_ids=[5, 9])
    assert h.dst_block_ids == (5, 9) and hash(h) == hash(header())
    with pytest.raises(AttributeError):
        h.layer = 3  # type: ignore[misc]


def test_a_wire_value_in_another_accepted_shape_decodes_to_the_field_type() -> None:
    """An int where a float is declared is a float once decoded, inside a nested record too; arrays are tuples."""
    data = wire(7, 5, batch_fields(deltas=[delta_fields(1, cumulative_logprob=-1, logprobs=[[[7, 3], [0, -1.5]]])]))
    (delta,) = decode(data).deltas  # type: ignore[attr-defined]
    assert delta.cumulative_logprob == -1.0 and type(delta.cumulative_logprob) is float
    assert delta.logprobs == (TokenLogprobs((7, 3), (0.0, -1.5)),) and type(delta.logprobs[0].logprobs[0]) is float
    assert type(delta.token_ids) is tuple and type(delta.logprobs[0].token_ids) is tuple


def test_event_batch_mirrors_kv_events() -> None:
    events = [KVEvent(KVEventKind.STORED, 11, 0), KVEvent(KVEventKind.STORED, 12, 11), KVEvent(KVEventKind.REMOVED, 11)]
    batch = decode(encode(KVEventBatch(worker_id="w", log_id="", first_seq=0, next_seq=3, snapshot=False,
                                       events=events)))
    assert isinstance(batch, KVEventBatch) and list(batch.events) == events


def wire(msg_type: int, version: int, fields: dict[str, object]) -> bytes:
    return msgpack.packb([msg_type, version, fields])


def header_fields(**over: object) -> dict[str, object]:
    fields = {k: v for k, v in msgpack.unpackb(encode(header()))[2].items()}
    fields.update(over)
    return fields


HELLO = {"sender_id": "x", "checksums": [], "nonce": "", "fingerprint": ""}
BATCH = EXAMPLES[-1]
assert isinstance(BATCH, TokenDeltaBatch)


def batch_fields(**over: object) -> dict[str, object]:
    fields = {k: v for k, v in msgpack.unpackb(encode(BATCH))[2].items()}
    fields.update(over)
    return fields


def event_fields(**over: object) -> dict[str, object]:
    """A KVEventBatch's wire fields (one event, seqs 0..1), some replaced."""
    fields: dict[str, object] = {"worker_id": "w", "log_id": "", "first_seq": 0, "next_seq": 1, "snapshot": False,
                                 "events": [["stored", 1, None]]}
    fields.update(over)
    return fields


def delta_fields(i: int, **over: object) -> list[object]:
    """Delta i of BATCH as its wire array, with some fields replaced."""
    names = [f.name for f in dataclasses.fields(TokenDelta)]
    values: list[object] = msgpack.unpackb(encode(BATCH))[2]["deltas"][i]
    for name, value in over.items():
        values[names.index(name)] = value
    return values


@pytest.mark.parametrize("data, match", [
    (b"", "not a msgpack message"),
    (b"\xc1", "not a msgpack message"),
    (b"\x93\x01", "not a msgpack message"),  # truncated
    (msgpack.packb({"type": 3}), r"expected \[type, version, fields\]"),
    (msgpack.packb([3, 1]), r"expected \[type, version, fields\]"),
    (wire(99, 1, {}), "unknown message type 99"),
    (wire(True, 2, HELLO), "unknown message type True"),  # a bool is not a type id
    (wire(1, 1, {"sender_id": "x", "checksums": []}), "version 1 is not supported"),  # no nonce: before the MAC
    (wire(1, "2", {"sender_id": "x", "checksums": []}), "version '2' is not supported"),
    (wire(1, 2, {"sender_id": "x", "nonce": "", "fingerprint": ""}), r"missing fields \['checksums'\]"),
    (wire(1, 2, {**HELLO, "admin": True}), r"unknown fields \['admin'\]"),
    (wire(1, 2, {**HELLO, "sender_id": 5}), "sender_id: expected str, got int"),
    (wire(1, 2, [("sender_id", "x")]), "fields must be a map"),
    (wire(2, 2, {"credits": 4, "checksum": "md5", "nonce": ""}), "checksum: 'md5' is not one of"),
    (wire(3, 1, header_fields(layer=True)), "layer: expected int, got bool"),
    (wire(3, 1, header_fields(layer=1.0)), "layer: expected int, got float"),
    (wire(3, 1, header_fields(dst_block_ids=["5", "9"])), r"dst_block_ids\[0\]: expected int, got str"),
    (wire(3, 1, header_fields(dst_block_ids=5)), "dst_block_ids: expected a sequence"),
    (wire(3, 1, header_fields(num_blocks=3)), "num_blocks: 3 != len"),
    (wire(3, 1, header_fields(checksum=1 << 40)), "checksum: not a 32-bit value"),
    (wire(3, 1, header_fields(checksum=-1)), "checksum: not a 32-bit value"),
    (wire(3, 1, header_fields(dtype=b"float16")), "dtype: expected str, got bytes"),
    (wire(4, 1, {"request_id": "r", "transfer_id": 1, "seq": 0, "state": "exploded", "reason": None,
                 "detail": "", "credits": 1}), "state: 'exploded' is not one of"),
    (wire(6, 2, event_fields(events=[["stored", -1, None]])), "block_hash: expected a 64-bit"),
    (wire(6, 2, event_fields(events=[["stored", 1]])), r"expected \[kind, block_hash"),
    (wire(6, 1, event_fields()), "version 1 is not supported"),
    (wire(6, 2, event_fields(next_seq=2)), r"1 events for seqs 0\.\.2"),
    (wire(6, 2, event_fields(first_seq=3)), r"seqs 3\.\.1"),
    (wire(6, 2, event_fields(snapshot=True)), "a snapshot is STORED events at one seq"),
    (wire(6, 2, event_fields(snapshot=True, next_seq=0, events=[["removed", 1, None]])), "a snapshot is STORED"),
    # Records nested in a message (a step's token deltas), read by per-class readers and checked field by field.
    (wire(7, 5, batch_fields(deltas=5)), "deltas: expected a sequence"),
    (wire(7, 5, batch_fields(deltas=[["r1", 0]])), "expected the 13 fields of TokenDelta as an array"),
    (wire(7, 5, batch_fields(deltas=[delta_fields(1, token_ids=["5"])])), r"token_ids\[0\]: expected int, got str"),
    (wire(7, 5, batch_fields(deltas=[delta_fields(1, offset=True)])), "offset: expected int, got bool"),
    (wire(7, 5, batch_fields(deltas=[delta_fields(1, text=None)])), "text: expected str, got NoneType"),
    (wire(7, 5, batch_fields(deltas=[delta_fields(1, logprobs=[["x"]])])), "expected the 2 fields of TokenLogprobs"),
    (wire(7, 5, batch_fields(deltas=[delta_fields(1, logprobs=[[[7], [-0.25, -1.5]]])])), "1 token ids but 2 logprobs"),
    (wire(7, 5, batch_fields(deltas=[delta_fields(1, logprobs=[[[7], ["-0.25"]]])])),
     r"logprobs\[0\]: expected float, got str"),
    (msgpack.packb([1, 2, {**HELLO, "sender_id": msgpack.ExtType(42, b"x")}]),
     "sender_id: expected str, got ExtType"),
    (b"\x00" * (2 << 20), "message limit"),
])
def test_decode_rejects_what_is_not_exactly_a_known_message(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode(data)


def test_a_pickle_payload_is_rejected_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for payload in (pickle.dumps(Exploit(marker)), pickle.dumps(header()), pickle.dumps(Exploit(marker), protocol=0)):
        with pytest.raises(ValueError):
            decode(payload)
    assert not marker.exists()


def test_construction_checks_types_too() -> None:
    with pytest.raises(ValueError, match="seq: expected int, got bool"):
        header(seq=False)
    with pytest.raises(ValueError, match="version 3 is not supported"):
        KVTransferHello(sender_id="x", checksums=(), nonce="", version=3)
    with pytest.raises(ValueError, match="end marker"):
        header(is_last=True)
    with pytest.raises(ValueError, match="reason goes with"):
        KVTransferAck(request_id="r", transfer_id=1, seq=0, state=TransferState.DONE, reason=FailReason.TIMEOUT)
    with pytest.raises(ValueError, match="not a registered message"):
        encode(object())  # type: ignore[arg-type]
