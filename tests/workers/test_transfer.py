"""Typed messages and the KV transport: the in-process and ZeroMQ backends move the
right bytes into the right blocks, and every failure path ends in a clear state
at its deadline, with nothing wrong written into the cache.

Network tests use loopback only; every wait has a deadline of a few seconds at most.
"""

from __future__ import annotations

import pickle
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
import torch

from pdserve.workers.kv.events import KVEvent, KVEventKind
from pdserve.workers.messages import (
    ChecksumKind,
    FailReason,
    KVCreditGrant,
    KVEventBatch,
    KVTransferAbort,
    KVTransferAck,
    KVTransferHeader,
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
from pdserve.workers.transfer import KVReceiver, KVSender, TransferError, frames
from pdserve.workers.transfer.faults import Faults
from pdserve.workers.transfer.inprocess import InProcessReceiver, InProcessSender

try:
    from pdserve.workers.transfer import zmq_backend
except ImportError:  # pyzmq is optional; the message and in-process tests still run
    zmq_backend = None  # type: ignore[assignment]

BLOCK = (4, 2, 8)  # block_size, kv heads, head dim: small, so each test moves kilobytes
SENTINEL = -3.0  # what the receiver's cache holds where nothing may be written


def soon(seconds: float) -> float:
    return time.monotonic() + seconds


def make_cache(num_layers: int, num_blocks: int, *, seed: int | None = None, dtype: torch.dtype = torch.float16,
               block: tuple[int, int, int] = BLOCK) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Per layer (K, V) views into one [L, 2, NB, bs, H, D] tensor, as workers/kv/cache.py allocates them.

    Random values when seeded (a sender), else SENTINEL everywhere (a receiver)."""
    full = torch.full((num_layers, 2, num_blocks, *block), SENTINEL, dtype=dtype)
    if seed is not None:
        full.copy_(torch.randn(full.shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
    return [(full[i, 0], full[i, 1]) for i in range(num_layers)], full


def eventually(check: Callable[[], bool], seconds: float = 2.0) -> bool:
    """Poll `check` until true or `seconds` pass (the ZeroMQ receiver applies messages on its own thread)."""
    end = soon(seconds)
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.005)
    return check()


@dataclass
class Link:
    sender: KVSender
    receiver: KVReceiver
    src: torch.Tensor  # [L, 2, NB, bs, H, D] of the sender
    dst: torch.Tensor  # the same of the receiver, which has more blocks
    faults: Faults

    def expect_moved(self, layers: range, src_ids: list[int], dst_ids: list[int], before: torch.Tensor) -> None:
        """Exactly the chosen blocks of the chosen layers changed, each to its source block."""
        want = before.clone()
        want[layers.start : layers.stop, :, dst_ids] = self.src[layers.start : layers.stop, :, src_ids]
        assert torch.equal(self.dst, want)


LinkFactory = Callable[..., Link]


def link_factory(backend: str, made: list[Link]) -> LinkFactory:
    def make(*, layers: int = 3, src_blocks: int = 8, dst_blocks: int = 20, credits: int = 8,
             dtype: torch.dtype = torch.float16, src_block: tuple[int, int, int] = BLOCK,
             checksum: ChecksumKind = frames.CHECKSUMS[0], max_message_bytes: int = 2 << 20) -> Link:
        """A sender (8 blocks) and a receiver (20 blocks, all SENTINEL) over `backend`."""
        src_kv, src = make_cache(layers, src_blocks, seed=1, dtype=dtype, block=src_block)
        dst_kv, dst = make_cache(layers, dst_blocks, dtype=dtype)
        faults = Faults()
        if backend == "inprocess":
            receiver: KVReceiver = InProcessReceiver(dst_kv)
            sender: KVSender = InProcessSender(src_kv, receiver, faults=faults,  # type: ignore[arg-type]
                                               checksum=checksum)
        else:
            if zmq_backend is None:
                pytest.skip("pyzmq is not installed")
            receiver = zmq_backend.ZmqKVReceiver(dst_kv, "tcp://127.0.0.1:*", credits=credits, faults=faults)
            sender = zmq_backend.ZmqKVSender(src_kv, receiver.address, faults=faults, checksums=[checksum],
                                             max_message_bytes=max_message_bytes)
        made.append(Link(sender, receiver, src, dst, faults))
        return made[-1]

    return make


def close_all(made: list[Link]) -> None:
    for lk in made:
        lk.sender.close()
        lk.receiver.close()
        if zmq_backend is not None and isinstance(lk.receiver, zmq_backend.ZmqKVReceiver):
            assert not lk.receiver.thread_alive


@pytest.fixture(params=["inprocess", "zmq"])
def link(request: pytest.FixtureRequest) -> Iterator[LinkFactory]:
    made: list[Link] = []
    yield link_factory(request.param, made)
    close_all(made)


@pytest.fixture
def zmq_link() -> Iterator[LinkFactory]:
    made: list[Link] = []
    yield link_factory("zmq", made)
    close_all(made)


@pytest.fixture
def inprocess_link() -> Iterator[LinkFactory]:
    made: list[Link] = []
    yield link_factory("inprocess", made)
    close_all(made)


# -- messages ------------------------------------------------------------------------


def header(**over: object) -> KVTransferHeader:
    fields: dict[str, object] = dict(request_id="r1", transfer_id=7, seq=0, layer=2, dst_block_ids=(5, 9),
                                     num_blocks=2, dtype="float16", block_shape=(16, 8, 128),
                                     checksum_kind=ChecksumKind.CRC32, checksum=0xDEADBEEF)
    fields.update(over)
    return KVTransferHeader(**fields)  # type: ignore[arg-type]


EXAMPLES: list[Message] = [
    KVTransferHello(sender_id="prefill-0", checksums=("xxh3_64", "crc32")),
    KVCreditGrant(credits=8, checksum=ChecksumKind.CRC32),
    header(),
    header(checksum_kind=ChecksumKind.XXH3_64, checksum=(1 << 64) - 1),
    header(dst_block_ids=(), num_blocks=0, seq=32, is_last=True),
    KVTransferAck(request_id="r1", transfer_id=7, seq=3, state=TransferState.PENDING),
    KVTransferAck(request_id="r1", transfer_id=7, seq=3, state=TransferState.FAILED, reason=FailReason.CHECKSUM,
                  detail="crc32 mismatch"),
    KVTransferAbort(request_id="r1", transfer_id=7, reason="client went away"),
    KVEventBatch(worker_id="prefill-0", batch_seq=4, events=(
        KVEvent(KVEventKind.STORED, (1 << 64) - 1, 0), KVEvent(KVEventKind.REMOVED, 12345))),
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


def test_event_batch_mirrors_kv_events() -> None:
    events = [KVEvent(KVEventKind.STORED, 11, 0), KVEvent(KVEventKind.STORED, 12, 11), KVEvent(KVEventKind.REMOVED, 11)]
    batch = decode(encode(KVEventBatch(worker_id="w", batch_seq=0, events=events)))
    assert isinstance(batch, KVEventBatch) and list(batch.events) == events


def wire(msg_type: int, version: int, fields: dict[str, object]) -> bytes:
    return msgpack.packb([msg_type, version, fields])


def header_fields(**over: object) -> dict[str, object]:
    fields = {k: v for k, v in msgpack.unpackb(encode(header()))[2].items()}
    fields.update(over)
    return fields


@pytest.mark.parametrize("data, match", [
    (b"", "not a msgpack message"),
    (b"\xc1", "not a msgpack message"),
    (b"\x93\x01", "not a msgpack message"),  # truncated
    (msgpack.packb({"type": 3}), r"expected \[type, version, fields\]"),
    (msgpack.packb([3, 1]), r"expected \[type, version, fields\]"),
    (wire(99, 1, {}), "unknown message type 99"),
    (wire(True, 1, {"sender_id": "x", "checksums": []}), "unknown message type True"),  # a bool is not a type id
    (wire(1, 2, {"sender_id": "x", "checksums": []}), "version 2 is not supported"),
    (wire(1, "1", {"sender_id": "x", "checksums": []}), "version '1' is not supported"),
    (wire(1, 1, {"sender_id": "x"}), r"missing fields \['checksums'\]"),
    (wire(1, 1, {"sender_id": "x", "checksums": [], "admin": True}), r"unknown fields \['admin'\]"),
    (wire(1, 1, {"sender_id": 5, "checksums": []}), "sender_id: expected str, got int"),
    (wire(1, 1, [("sender_id", "x")]), "fields must be a map"),
    (wire(2, 1, {"credits": 4, "checksum": "md5"}), "checksum: 'md5' is not one of"),
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
    (wire(6, 1, {"worker_id": "w", "batch_seq": 0, "events": [["stored", -1, None]]}), "block_hash: expected a 64-bit"),
    (wire(6, 1, {"worker_id": "w", "batch_seq": 0, "events": [["stored", 1]]}), r"expected \[kind, block_hash"),
    (msgpack.packb([1, 1, {"sender_id": msgpack.ExtType(42, b"x"), "checksums": []}]),
     "sender_id: expected str, got ExtType"),
    (b"\x00" * (2 << 20), "message limit"),
])
def test_decode_rejects_what_is_not_exactly_a_known_message(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode(data)


class _Exploit:
    """Unpickling this runs code: writes a file. decode() must never get that far."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def test_a_pickle_payload_is_rejected_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for payload in (pickle.dumps(_Exploit(marker)), pickle.dumps(header()), pickle.dumps(_Exploit(marker), protocol=0)):
        with pytest.raises(ValueError):
            decode(payload)
    assert not marker.exists()


def test_construction_checks_types_too() -> None:
    with pytest.raises(ValueError, match="seq: expected int, got bool"):
        header(seq=False)
    with pytest.raises(ValueError, match="version 3 is not supported"):
        KVTransferHello(sender_id="x", checksums=(), version=3)
    with pytest.raises(ValueError, match="end marker"):
        header(is_last=True)
    with pytest.raises(ValueError, match="reason goes with"):
        KVTransferAck(request_id="r", transfer_id=1, seq=0, state=TransferState.DONE, reason=FailReason.TIMEOUT)
    with pytest.raises(ValueError, match="not a registered message"):
        encode(object())  # type: ignore[arg-type]


# -- the transport: happy paths --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_moves_chosen_blocks_into_the_right_destination_blocks(link: LinkFactory, dtype: torch.dtype) -> None:
    lk = link(layers=3, src_blocks=8, dst_blocks=20, dtype=dtype)
    src_ids, dst_ids = [6, 1, 2, 3, 0], [17, 4, 5, 6, 11]  # scattered and in-a-row runs on both sides
    before = lk.dst.clone()
    lk.receiver.register("req", dst_ids, expected_layers=3)
    for layer in range(3):  # two chunks per layer, as chunked prefill sends them
        lk.sender.send("req", layer, src_ids[:2], dst_ids[:2], soon(2))
        lk.sender.send("req", layer, src_ids[2:], dst_ids[2:], soon(2))
    lk.sender.finish("req", soon(3))
    assert lk.receiver.wait("req", soon(3)).state is TransferState.DONE
    lk.expect_moved(range(3), src_ids, dst_ids, before)
    lk.receiver.release("req")


def test_layers_stream_one_at_a_time_and_the_state_is_pending_until_the_last(link: LinkFactory) -> None:
    lk = link(layers=4)
    src_ids, dst_ids = [0, 1, 2], [10, 11, 12]
    before = lk.dst.clone()
    lk.receiver.register("req", dst_ids, expected_layers=4)
    for layer in range(4):
        lk.sender.send("req", layer, src_ids, dst_ids, soon(2))
        # The layer lands while later ones are still "being computed", yet the transfer is not DONE.
        assert eventually(lambda: torch.equal(lk.dst[layer][:, dst_ids], lk.src[layer][:, src_ids]))
        assert lk.receiver.poll("req").state is TransferState.PENDING
    assert torch.equal(lk.dst[:, :, 13:], before[:, :, 13:])
    lk.sender.finish("req", soon(3))
    assert lk.receiver.poll("req").state is TransferState.DONE
    lk.expect_moved(range(4), src_ids, dst_ids, before)


def test_two_requests_interleave_on_one_link(link: LinkFactory) -> None:
    lk = link(layers=2)
    before = lk.dst.clone()
    lk.receiver.register("a", [0, 1], expected_layers=2)
    lk.receiver.register("b", [2, 3], expected_layers=2)
    for layer in range(2):
        lk.sender.send("a", layer, [4, 5], [0, 1], soon(2))
        lk.sender.send("b", layer, [6, 7], [2, 3], soon(2))
    lk.sender.finish("b", soon(3))
    lk.sender.finish("a", soon(3))
    assert lk.receiver.poll("a").state is lk.receiver.poll("b").state is TransferState.DONE
    lk.expect_moved(range(2), [4, 5, 6, 7], [0, 1, 2, 3], before)


# -- failure paths ----------------------------------------------------------------------


def test_corrupted_frame_fails_with_checksum_and_writes_nothing_wrong(link: LinkFactory) -> None:
    lk = link(layers=3)
    src_ids, dst_ids = [0, 1], [8, 9]
    before = lk.dst.clone()
    lk.receiver.register("req", dst_ids, expected_layers=3)
    lk.faults.corrupt(layer=1)
    raised = None
    for layer in range(3):
        try:
            lk.sender.send("req", layer, src_ids, dst_ids, soon(2))
        except TransferError as e:  # the receiver's verdict may already be back: the transfer is over
            raised = e
            break
    status = lk.receiver.wait("req", soon(2))
    assert status.state is TransferState.FAILED and status.reason is FailReason.CHECKSUM
    assert "!= header's" in status.detail
    # Layer 0 arrived intact before the bad one; the bad layer and everything after are untouched.
    lk.expect_moved(range(1), src_ids, dst_ids, before)
    if raised is None:
        with pytest.raises(TransferError) as err:
            lk.sender.finish("req", soon(2))
        raised = err.value
    assert raised.reason is FailReason.CHECKSUM


@pytest.mark.parametrize("kind", list(ChecksumKind))
def test_each_checksum_kind_moves_blocks_and_catches_a_flipped_byte(link: LinkFactory, kind: ChecksumKind) -> None:
    if kind not in frames.CHECKSUMS:
        pytest.skip(f"{kind.value} needs a package that is not installed")
    lk = link(layers=2, checksum=kind)
    before = lk.dst.clone()
    lk.receiver.register("good", [3, 4], expected_layers=2)
    lk.receiver.register("bad", [5], expected_layers=2)
    for layer in range(2):
        lk.sender.send("good", layer, [0, 1], [3, 4], soon(2))
    lk.sender.finish("good", soon(2))
    lk.faults.corrupt(request_id="bad")
    lk.sender.send("bad", 0, [2], [5], soon(2))
    status = lk.receiver.wait("bad", soon(2))
    assert status.reason is FailReason.CHECKSUM and kind.value in status.detail
    lk.expect_moved(range(2), [0, 1], [3, 4], before)  # block 5 untouched


def test_the_receiver_picks_a_checksum_both_ends_compute() -> None:
    assert frames.pick_checksum(["blake9", "crc32"]) is ChecksumKind.CRC32  # unknown kinds are skipped
    assert frames.pick_checksum([]) is ChecksumKind.CRC32
    assert frames.pick_checksum([k.value for k in frames.CHECKSUMS]) is frames.CHECKSUMS[0]


def test_crc32_gives_zlib_values_at_every_size_and_continues_like_it() -> None:
    data = torch.randint(0, 256, (100_003,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).numpy()
    for n in (0, 1, 4095, 4096, 65_537, 100_003):
        assert frames.crc32(data[:n]) == zlib.crc32(data[:n])
        assert frames.crc32(data[n:], frames.crc32(data[:n])) == zlib.crc32(data)
    assert frames.crc32(memoryview(data.tobytes())) == frames.crc32(data.tobytes()) == zlib.crc32(data)


def test_blocks_in_a_row_are_framed_without_a_copy_and_others_are_gathered() -> None:
    kv, _ = make_cache(2, 8, seed=3)
    views = frames.cache_frames(kv, 1, [2, 3, 4])
    assert views is not None
    gathered = frames.gather(kv, 1, [2, 3, 4])
    assert all((a == b).all() for a, b in zip(views, gathered))
    assert all(view.ctypes.data == t[2].data_ptr() for view, t in zip(views, kv[1]))  # the cache's own memory
    assert frames.cache_frames(kv, 1, [2, 4]) is None
    assert frames.cache_frames(kv, 1, [3, 2]) is None


def test_a_zmq_sender_uses_the_checksum_the_receiver_named(zmq_link: LinkFactory) -> None:
    lk = zmq_link(layers=1, checksum=ChecksumKind.CRC32)
    lk.receiver.register("req", [3], expected_layers=1)
    lk.sender.send("req", 0, [0], [3], soon(2))
    lk.sender.finish("req", soon(2))
    assert lk.sender.checksum is ChecksumKind.CRC32  # type: ignore[attr-defined]


@pytest.mark.parametrize("lost", ["data", "end marker"])
def test_a_lost_message_makes_wait_time_out_at_its_deadline(link: LinkFactory, lost: str) -> None:
    lk = link(layers=3)
    lk.receiver.register("req", [3, 4], expected_layers=3)
    if lost == "data":
        lk.faults.drop(layer=1)
    else:
        lk.faults.drop(end_marker=True)
    for layer in range(3):
        lk.sender.send("req", layer, [0, 1], [3, 4], soon(2))
    finisher = threading.Thread(target=_finish_quietly, args=(lk.sender, "req", soon(2.0)))
    if lost == "end marker":
        finisher.start()  # the sender's finish() is what the drop hits; it must not hang either
    start = time.monotonic()
    status = lk.receiver.wait("req", start + 0.3)
    took = time.monotonic() - start
    assert status.state is TransferState.FAILED and status.reason is FailReason.TIMEOUT
    assert 0.29 <= took < 0.8, took
    assert "1/3 layers" in status.detail or "end marker not seen" in status.detail
    if lost == "end marker":
        finisher.join(3)
        assert not finisher.is_alive()
    else:
        with pytest.raises(TransferError):  # the receiver told the sender to stop
            lk.sender.finish("req", soon(2))


def _finish_quietly(sender: KVSender, request_id: str, deadline: float) -> None:
    try:
        sender.finish(request_id, deadline)
    except TransferError:
        pass


def test_abort_by_the_sender_fails_the_receiver(link: LinkFactory) -> None:
    lk = link(layers=3)
    lk.receiver.register("req", [3, 4], expected_layers=3)
    lk.sender.send("req", 0, [0, 1], [3, 4], soon(2))
    lk.sender.abort("req", "client disconnected")
    status = lk.receiver.wait("req", soon(2))
    assert status.state is TransferState.FAILED and status.reason is FailReason.ABORTED
    assert "aborted by the sender: client disconnected" in status.detail
    lk.sender.abort("req", "again")  # idempotent


def test_closing_the_sender_aborts_its_unfinished_transfers(link: LinkFactory) -> None:
    lk = link(layers=2)
    lk.receiver.register("req", [3], expected_layers=2)
    lk.sender.send("req", 0, [0], [3], soon(2))
    lk.sender.close()
    status = lk.receiver.wait("req", soon(2))
    assert status.reason is FailReason.ABORTED and "sender closed" in status.detail


def test_abort_by_the_receiver_stops_the_sender_and_nothing_more_is_written(link: LinkFactory) -> None:
    lk = link(layers=4)
    lk.receiver.register("req", [3, 4], expected_layers=4)
    lk.sender.send("req", 0, [0, 1], [3, 4], soon(2))
    assert eventually(lambda: torch.equal(lk.dst[0][:, [3, 4]], lk.src[0][:, [0, 1]]))
    lk.receiver.abort("req", "decode worker cancelled it")
    after_abort = lk.dst.clone()  # from here the blocks may be reused: no write may land

    def next_send_fails() -> bool:
        try:
            lk.sender.send("req", 1, [0, 1], [3, 4], soon(1))
        except TransferError as e:
            assert e.reason in (FailReason.ABORTED, FailReason.UNKNOWN_REQUEST), e
            return True
        return False

    assert eventually(next_send_fails, seconds=3)
    time.sleep(0.05)
    assert torch.equal(lk.dst, after_abort)
    with pytest.raises(KeyError):
        lk.receiver.poll("req")  # abort also forgets it


def test_a_late_message_after_the_timeout_is_not_written(inprocess_link: LinkFactory) -> None:
    # In-process only: it can hold a message back without blocking the sender (ZeroMQ keeps order).
    lk = inprocess_link(layers=2)
    lk.receiver.register("req", [3, 4], expected_layers=2)
    lk.faults.delay(0.4, layer=1)
    before = lk.dst.clone()
    for layer in range(2):
        lk.sender.send("req", layer, [0, 1], [3, 4], soon(2))
    assert lk.receiver.wait("req", soon(0.1)).reason is FailReason.TIMEOUT
    time.sleep(0.6)  # the delayed layer 1 arrives now, to blocks the decode worker may have reused
    lk.expect_moved(range(1), [0, 1], [3, 4], before)


def test_messages_for_unregistered_requests_or_blocks_are_refused(link: LinkFactory) -> None:
    lk = link(layers=2)
    before = lk.dst.clone()
    lk.sender.send("nobody", 0, [0], [3], soon(2))
    with pytest.raises(TransferError) as err:
        lk.sender.finish("nobody", soon(2))
    assert err.value.reason is FailReason.UNKNOWN_REQUEST
    lk.receiver.register("req", [3, 4], expected_layers=2)
    lk.sender.send("req", 0, [0, 1], [3, 5], soon(2))  # block 5 belongs to someone else
    status = lk.receiver.wait("req", soon(2))
    assert status.reason is FailReason.PROTOCOL and "not registered" in status.detail
    assert torch.equal(lk.dst, before)


def test_a_sender_that_finishes_early_fails_the_transfer(link: LinkFactory) -> None:
    lk = link(layers=3)
    lk.receiver.register("req", [3, 4], expected_layers=3)
    lk.sender.send("req", 0, [0, 1], [3, 4], soon(2))
    with pytest.raises(TransferError) as err:
        lk.sender.finish("req", soon(2))
    assert err.value.reason is FailReason.PROTOCOL and "layers [1, 2]" in err.value.detail


def test_mismatched_cache_geometry_is_refused(link: LinkFactory) -> None:
    lk = link(layers=2, src_block=(4, 2, 16))  # head dim 16 on the sender, 8 on the receiver
    lk.receiver.register("req", [3], expected_layers=2)
    lk.sender.send("req", 0, [0], [3], soon(2))
    status = lk.receiver.wait("req", soon(2))
    assert status.reason is FailReason.PROTOCOL and "block shape" in status.detail


def test_bad_arguments_raise_value_errors(link: LinkFactory) -> None:
    lk = link(layers=2, src_blocks=8, dst_blocks=20)
    for bad in ([20], [1, 1], []):
        with pytest.raises(ValueError):
            lk.receiver.register("x", bad, expected_layers=1)
    with pytest.raises(ValueError, match="expected_layers"):
        lk.receiver.register("x", [1], expected_layers=3)
    lk.receiver.register("x", [1], expected_layers=1)
    with pytest.raises(ValueError, match="already registered"):
        lk.receiver.register("x", [2], expected_layers=1)
    with pytest.raises(ValueError, match="layer"):
        lk.sender.send("x", 2, [0], [1], soon(1))
    with pytest.raises(ValueError, match="outside"):
        lk.sender.send("x", 0, [8], [1], soon(1))
    with pytest.raises(ValueError, match="same non-zero count"):
        lk.sender.send("x", 0, [0, 1], [1], soon(1))
    with pytest.raises(KeyError):
        lk.receiver.poll("never")


# -- ZeroMQ: flow control, the socket, threads --------------------------------------------------


def test_a_receiver_that_does_not_drain_blocks_the_sender_at_its_credit_window(zmq_link: LinkFactory) -> None:
    lk = zmq_link(layers=4, credits=2)
    src_ids, dst_ids = [0, 1], [3, 4]
    before = lk.dst.clone()
    lk.receiver.register("req", dst_ids, expected_layers=4)
    lk.faults.stall_receiver()
    start = time.monotonic()
    lk.sender.send("req", 0, src_ids, dst_ids, soon(2))
    lk.sender.send("req", 1, src_ids, dst_ids, soon(2))
    assert time.monotonic() - start < 1.0  # two credits: no waiting
    start = time.monotonic()
    with pytest.raises(TransferError) as err:
        lk.sender.send("req", 2, src_ids, dst_ids, start + 0.3)
    took = time.monotonic() - start
    assert err.value.reason is FailReason.TIMEOUT and "not draining" in err.value.detail
    assert 0.29 <= took < 0.8, took
    assert torch.equal(lk.dst, before)  # nothing was drained, nothing written
    lk.faults.resume_receiver()
    lk.sender.send("req", 2, src_ids, dst_ids, soon(2))  # the retry gets the returned credits
    lk.sender.send("req", 3, src_ids, dst_ids, soon(2))
    lk.sender.finish("req", soon(2))
    assert lk.receiver.poll("req").state is TransferState.DONE
    lk.expect_moved(range(4), src_ids, dst_ids, before)
    assert eventually(lambda: lk.sender.credits == 2)  # every credit came back


def test_a_layer_bigger_than_one_message_goes_in_several(zmq_link: LinkFactory) -> None:
    block_bytes = 2 * BLOCK[0] * BLOCK[1] * BLOCK[2] * 2  # K and V of one fp16 block
    lk = zmq_link(layers=2, credits=2, max_message_bytes=2 * block_bytes)  # 2 blocks a message, 2 in flight
    src_ids, dst_ids = [7, 0, 1, 2, 5], [19, 3, 4, 5, 12]
    before = lk.dst.clone()
    lk.receiver.register("req", dst_ids, expected_layers=2)
    for layer in range(2):
        lk.sender.send("req", layer, src_ids, dst_ids, soon(2))  # 3 messages: waits for credits mid-layer
    lk.sender.finish("req", soon(2))
    assert lk.receiver.poll("req").state is TransferState.DONE
    lk.expect_moved(range(2), src_ids, dst_ids, before)


def test_finish_times_out_at_its_deadline_and_aborts_the_receiver(zmq_link: LinkFactory) -> None:
    lk = zmq_link(layers=1, credits=4)
    lk.receiver.register("req", [3], expected_layers=1)
    lk.faults.stall_receiver()
    lk.sender.send("req", 0, [0], [3], soon(2))
    start = time.monotonic()
    with pytest.raises(TransferError) as err:
        lk.sender.finish("req", start + 0.3)
    assert err.value.reason is FailReason.TIMEOUT and 0.29 <= time.monotonic() - start < 0.8
    status = lk.receiver.wait("req", soon(2))  # the abort is a control message: it passes a stalled receiver
    assert status.reason is FailReason.ABORTED and "sender gave up" in status.detail


def test_the_receiver_survives_garbage_and_pickles_on_its_socket(zmq_link: LinkFactory, tmp_path: Path) -> None:
    import zmq

    lk = zmq_link(layers=1)
    marker = tmp_path / "pwned"
    rogue = zmq.Context.instance().socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(lk.receiver.address)  # type: ignore[attr-defined]
    try:
        rogue.send_multipart([pickle.dumps(_Exploit(marker)), b"k", b"v"])
        rogue.send(b"\xff\x00garbage")
        rogue.send_multipart([encode(header(request_id="req")), b"\x00" * 8, b"\x00" * 8])  # no credit, unregistered
        assert rogue.poll(2000)
        rogue.recv()  # an ack that refuses it, not a crash
    finally:
        rogue.close()
    lk.receiver.register("req", [3], expected_layers=1)
    lk.sender.send("req", 0, [0], [3], soon(2))
    lk.sender.finish("req", soon(2))
    assert lk.receiver.poll("req").state is TransferState.DONE
    assert not marker.exists()


def test_close_fails_pending_transfers_wakes_waiters_and_joins_the_thread(zmq_link: LinkFactory) -> None:
    lk = zmq_link(layers=2)
    lk.receiver.register("req", [3], expected_layers=2)
    lk.sender.send("req", 0, [0], [3], soon(2))
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(lk.receiver.wait("req", soon(5))))
    waiter.start()
    time.sleep(0.05)
    start = time.monotonic()
    lk.receiver.close()
    waiter.join(2)
    assert time.monotonic() - start < 2.5
    assert not waiter.is_alive() and not lk.receiver.thread_alive  # type: ignore[attr-defined]
    assert result[0].reason is FailReason.CLOSED  # type: ignore[attr-defined]
    lk.receiver.close()  # idempotent
    lk.sender.close()
    with pytest.raises(TransferError) as err:
        lk.sender.send("req", 1, [0], [3], soon(1))
    assert err.value.reason is FailReason.CLOSED
