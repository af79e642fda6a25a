"""The torch.distributed KV transport (`nccl_backend`), run through gloo on the CPU.

The same code path as NCCL on GPUs, minus the device: per-pair two-rank groups built
without `init_process_group`, the tensor of each message posted before its ZeroMQ header,
checksums and the shared ledger on the receiver. Sender and receiver live in this process on
different threads (their groups rendezvous through the receiver's store, served on its ROUTER over
loopback), and one test runs the sender in a second process. Every wait has a deadline of a few seconds.

What every backend does (the conformance cases) runs over this one too, in test_transfer.py; here is
what only this backend does: no checksums by default (either end may ask for them), a second process,
a data channel that never forms or breaks, writes queued on a copy stream that a transfer's end waits for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import zmq
from kv_links import (
    BLOCK,
    GROUP_TIMEOUT_S,
    SENTINEL,
    Links,
    RawPeer,
    close_while_waiting,
    eventually,
    make_cache,
    soon,
)

from pdserve.workers.messages import (
    ChecksumKind,
    FailReason,
    KVCreditGrant,
    KVTransferHeader,
    TransferState,
    encode,
)
from pdserve.workers.transfer import TransferError, auth, frames, streams
from pdserve.workers.transfer.ledger import ReceiverLedger
from pdserve.workers.transfer.nccl_backend import NcclKVReceiver, NcclKVSender, parse_address
from pdserve.workers.transfer.zmq_backend import ZmqKVSender

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


@pytest.fixture
def link() -> Iterator[Links]:
    made = Links("nccl")
    yield made
    made.close()


# -- happy paths -----------------------------------------------------------------------------------


def test_without_checksums_the_ledger_still_decides_what_is_written(link: Links) -> None:
    # verify_checksums=False is the GPU fast path (no device-to-host copy); on the CPU it runs the same code.
    lk = link(layers=2, verify=False)
    before = lk.dst.clone()
    lk.receiver.register("req", [3, 4], expected_layers=2)
    lk.receiver.register("other", [7], expected_layers=1)
    lk.send_layers("req", 2, [5, 2], [3, 4], finish_s=3)
    assert lk.receiver.poll("req").state is TransferState.DONE
    lk.expect_moved(range(2), [5, 2], [3, 4], before)
    lk.sender.send("other", 0, [0, 1], [7, 8], soon(2))  # block 8 is not registered for it
    status = lk.receiver.wait("other", soon(2))
    assert status.reason is FailReason.PROTOCOL and "not registered" in status.detail
    lk.expect_moved(range(2), [5, 2], [3, 4], before)


def test_by_default_neither_end_checksums_and_the_kv_arrives_exact(link: Links) -> None:
    # The defaults of both ends: the grant names no checksum, so no message is hashed on the host (on a GPU,
    # a device-to-host copy of every message on each side). What that gives up: a flipped byte goes unseen.
    lk = link(layers=2, verify=None)
    before = lk.dst.clone()
    lk.receiver.register("req", [3, 4, 9], expected_layers=2)
    lk.receiver.register("run", [10, 11], expected_layers=1)
    lk.send_layers("req", 2, [5, 2, 6], [3, 4, 9], finish_s=3)  # scattered source blocks: index_select(out=)
    assert lk.receiver.poll("req").state is TransferState.DONE
    lk.expect_moved(range(2), [5, 2, 6], [3, 4, 9], before)
    before = lk.dst.clone()
    lk.send_layers("run", 1, [0, 1], [10, 11], finish_s=3)  # blocks in a row: one slice copy
    assert lk.receiver.poll("run").state is TransferState.DONE
    lk.expect_moved(range(1), [0, 1], [10, 11], before)
    assert lk.sender.checksum is ChecksumKind.NONE
    assert lk.sender.num_checksummed == 0 and lk.receiver.num_checksummed == 0
    lk.receiver.register("flipped", [12], expected_layers=1)
    lk.faults.corrupt(request_id="flipped")
    lk.send_layers("flipped", 1, [7], [12])
    assert lk.receiver.poll("flipped").state is TransferState.DONE
    assert not lk.dst[0, :, 12].equal(lk.src[0, :, 7])


@pytest.mark.parametrize("ends", [(True, None), (None, True)], ids=["the sender asks", "the receiver asks"])
def test_either_end_can_ask_for_checksums_and_then_both_take_them(link: Links, ends: tuple[bool, None]) -> None:
    lk = link(layers=2, verify=ends)
    before = lk.dst.clone()
    lk.receiver.register("good", [3, 4], expected_layers=2)
    lk.receiver.register("bad", [5], expected_layers=1)
    lk.send_layers("good", 2, [0, 1], [3, 4])
    assert lk.sender.checksum is ChecksumKind.CRC32  # what the link offered
    assert lk.sender.num_checksummed == lk.receiver.num_checksummed == 2
    lk.faults.corrupt(request_id="bad")
    lk.sender.send("bad", 0, [2], [5], soon(2))
    status = lk.receiver.wait("bad", soon(2))
    assert status.reason is FailReason.CHECKSUM
    lk.expect_moved(range(2), [0, 1], [3, 4], before)  # block 5 untouched


def test_a_receiver_that_verifies_refuses_a_message_without_a_checksum() -> None:
    # A sender that ignored the grant: its message is not written unverified.
    kv, full = make_cache(1, 4)
    ledger = ReceiverLedger(kv)
    ledger.register("req", [1], expected_layers=1)
    frame = np.zeros(frames.frame_bytes(ledger.geometry, 1) // 2, dtype=np.uint8)
    ack = ledger.apply(_data_header(ChecksumKind.NONE), frame, frame, peer="p")
    assert ack.reason is FailReason.PROTOCOL and "no checksum" in ack.detail
    assert (full == SENTINEL).all()


def test_the_sender_can_live_in_another_process(link: Links) -> None:
    lk = link(layers=3)
    src_ids, dst_ids = [4, 0, 7], [19, 2, 3]
    before = lk.dst.clone()
    lk.receiver.register("req", dst_ids, expected_layers=3)
    script = f"""
import sys, time, torch
from pdserve.workers.transfer.nccl_backend import NcclKVSender
full = torch.randn((3, 2, 8, *{BLOCK!r}), generator=torch.Generator().manual_seed(1)).to(torch.float16)
sender = NcclKVSender([(full[i, 0], full[i, 1]) for i in range(3)], sys.argv[1], group_timeout_s={GROUP_TIMEOUT_S})
for layer in range(3):
    sender.send("req", layer, {src_ids!r}, {dst_ids!r}, time.monotonic() + 3)
sender.finish("req", time.monotonic() + 3)
sender.close()
print("sent")
"""
    env = {**os.environ, auth.SECRET_ENV: auth.default_secret().key.hex()}  # the cluster's secret, as Ray hands it
    done = subprocess.run([sys.executable, "-c", script, lk.receiver.address], capture_output=True, text=True,
                          timeout=9, env=env)
    assert done.returncode == 0 and "sent" in done.stdout, done.stderr[-2000:]
    assert lk.receiver.wait("req", soon(2)).state is TransferState.DONE
    lk.expect_moved(range(3), src_ids, dst_ids, before)
    assert lk.receiver.senders == 2  # the fixture's sender and the other process's, each its own pair


# -- failure paths ---------------------------------------------------------------------------------


def test_a_sender_whose_data_channel_never_forms_fails_its_transfers_with_closed(link: Links) -> None:
    # A peer that says hello but never joins its group: the receiver's side gives up at the group timeout,
    # and every message from that peer then fails its transfer instead of waiting for bytes that never come.
    lk = link(layers=1, group_timeout_s=0.5)
    rogue = RawPeer(lk.receiver.address, routing_id=b"raw")  # holds the secret; its sender id is its routing id
    try:
        assert isinstance(rogue.hello(), KVCreditGrant)
        lk.receiver.register("req", [3], expected_layers=1)
        time.sleep(0.7)  # past the receiver's group timeout
        rogue.send(KVTransferHeader(
            request_id="req", transfer_id=5, seq=0, layer=0, dst_block_ids=(3,), num_blocks=1, dtype="float16",
            block_shape=BLOCK, checksum_kind=ChecksumKind.CRC32, checksum=0))
        ack = rogue.recv()
        assert ack is not None and ack.reason is FailReason.CLOSED
    finally:
        rogue.close()
    status = lk.receiver.poll("req")
    assert status.reason is FailReason.CLOSED and "not formed" in status.detail
    assert (lk.dst == SENTINEL).all()


def test_a_recv_whose_tensor_never_comes_ends_at_the_group_timeout(link: Links) -> None:
    # A sender stuck mid-message: its header arrived, its tensor does not. gloo cannot cancel the posted recv;
    # the group's timeout ends it, which breaks the pair, and the transfer fails instead of hanging.
    lk = link(layers=1, group_timeout_s=1.0)
    assert lk.sender.wait_ready(2)
    lk.receiver.register("req", [3], expected_layers=1)
    lk.receiver.register("other", [4], expected_layers=1)
    header = KVTransferHeader(request_id="req", transfer_id=5, seq=0, layer=0, dst_block_ids=(3,), num_blocks=1,
                              dtype="float16", block_shape=BLOCK, checksum_kind=ChecksumKind.CRC32, checksum=0)
    assert lk.sender.credits > 0  # the grant is read: the connection's key is known
    lk.sender._send_sealed([encode(header)])  # the header alone, behind the sender's back
    start = time.monotonic()
    time.sleep(0.1)
    lk.receiver.abort("other")  # the API stays responsive while the pair thread waits
    assert time.monotonic() - start < 0.5
    status = lk.receiver.wait("req", soon(3))
    took = time.monotonic() - start
    assert status.reason is FailReason.CLOSED and "recv failed" in status.detail
    assert 0.9 <= took < 2.0, took
    assert (lk.dst == SENTINEL).all()


def test_a_broken_pair_fails_fast_on_both_sides_and_the_next_send_pairs_again(link: Links) -> None:
    # A header announcing more than the receiver will stage cannot be received, so the pair is broken for
    # good: the transfer fails with CLOSED, and the sender, told so in the ack, shuts its side instead of
    # waiting on a send that no one will ever take. Its next send forms a new pair (a broken pair used to
    # fail every later transfer to that receiver, until the sender was made anew: never, in a worker).
    lk = link(layers=2, receive_limit=64)  # one block's K and V are 256 bytes
    lk.receiver.register("req", [3], expected_layers=2)
    lk.sender.send("req", 0, [0], [3], soon(2))
    status = lk.receiver.wait("req", soon(2))
    assert status.reason is FailReason.CLOSED and "cannot be received" in status.detail
    start = time.monotonic()
    with pytest.raises(TransferError) as err:
        lk.sender.finish("req", soon(2))
    assert err.value.reason is FailReason.CLOSED and time.monotonic() - start < 1.0
    assert (lk.dst == SENTINEL).all()
    lk.receiver._max_message_bytes = 1 << 20  # type: ignore[attr-defined]  # what broke it is gone
    before = lk.dst.clone()
    lk.receiver.register("next", [4, 5], expected_layers=2)
    lk.send_layers("next", 2, [1, 2], [4, 5], finish_s=GROUP_TIMEOUT_S + 2)
    assert lk.receiver.wait("next", soon(2)).state is TransferState.DONE
    lk.expect_moved(range(0, 2), [1, 2], [4, 5], before)
    assert lk.sender.num_repairs == 1  # type: ignore[attr-defined]


def test_a_pair_that_never_forms_is_tried_again_after_a_growing_wait(link: Links,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # A data channel that cannot form (a gloo or NCCL peer this host cannot reach) must not make every
    # transfer wait for a formation that fails again: between re-pairings (after 1, 2, 4 ... s) they fail
    # at once with CLOSED, as a broken pair's do.
    from pdserve.workers.transfer import nccl_backend

    def unreachable(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("connect: no route to host")

    monkeypatch.setattr(nccl_backend, "DataChannel", unreachable)
    lk = link(layers=1)
    assert not lk.sender.wait_ready(GROUP_TIMEOUT_S)  # type: ignore[attr-defined]
    lk.receiver.register("req", [3], expected_layers=1)

    def fails_closed() -> float:
        start = time.monotonic()
        with pytest.raises(TransferError) as err:
            lk.sender.send("req", 0, [0], [3], soon(GROUP_TIMEOUT_S + 2))
        assert err.value.reason in (FailReason.CLOSED, FailReason.TIMEOUT), err.value
        return time.monotonic() - start

    fails_closed()  # re-pairs (a new hello, a new formation), which fails again
    assert lk.sender.num_repairs == 1  # type: ignore[attr-defined]
    assert fails_closed() < 0.5 and lk.sender.num_repairs == 1  # type: ignore[attr-defined]  # within 1 s: at once
    time.sleep(1.0)
    fails_closed()
    assert lk.sender.num_repairs == 2  # type: ignore[attr-defined]


def test_pairs_past_the_bound_take_an_idle_ones_place_and_only_busy_ones_refuse() -> None:
    # A receiver keeps at most `max_senders` pairs (a ROUTER is not told a sender left: restarted or
    # re-paired senders leave theirs behind, and at the bound it refused every new sender for good). A new
    # sender takes an idle pair's place; the evicted sender's next transfer fails CLOSED and the one after
    # pairs again. Refused (told why, failing at once) are a sender while every pair has a transfer in
    # flight, and one whose sender id is not its routing id (a ZeroMQ-transport sender).
    src, blocks = make_cache(1, 4, seed=1)
    dst, full = make_cache(1, 8)
    receiver = NcclKVReceiver(dst, max_senders=1, group_timeout_s=GROUP_TIMEOUT_S)
    senders: list[Any] = []
    rogue = None
    try:
        first = NcclKVSender(src, receiver.address, group_timeout_s=GROUP_TIMEOUT_S)
        senders.append(first)
        assert first.wait_ready(GROUP_TIMEOUT_S + 1)  # paired: the receiver's one sender
        second = NcclKVSender(src, receiver.address, group_timeout_s=GROUP_TIMEOUT_S)  # takes its place
        senders.append(second)
        receiver.register("a", [3], expected_layers=1)
        second.send("a", 0, [0], [3], soon(GROUP_TIMEOUT_S + 2))
        second.finish("a", soon(2))
        assert receiver.wait("a", soon(2)).state is TransferState.DONE and receiver.senders == 1
        receiver.register("b", [4], expected_layers=1)
        with pytest.raises(TransferError) as err:  # its pair was dropped while idle
            first.send("b", 0, [1], [4], soon(2))
            first.finish("b", soon(2))
        assert err.value.reason is FailReason.CLOSED, err.value
        receiver.register("c", [5], expected_layers=1)
        first.send("c", 0, [1], [5], soon(GROUP_TIMEOUT_S + 2))  # pairs again, in the idle second's place
        first.finish("c", soon(2))
        assert receiver.wait("c", soon(2)).state is TransferState.DONE and first.num_repairs == 1
        assert torch.equal(full[0, :, [3, 5]], blocks[0, :, [0, 1]]) and (full[0, :, 4] == SENTINEL).all()

        rogue = RawPeer(receiver.address, routing_id=b"raw")  # pairs, then a header whose tensor never comes
        assert isinstance(rogue.hello(), KVCreditGrant)
        receiver.register("d", [6], expected_layers=1)
        rogue.send(KVTransferHeader(
            request_id="d", transfer_id=5, seq=0, layer=0, dst_block_ids=(6,), num_blocks=1, dtype="float16",
            block_shape=BLOCK, checksum_kind=ChecksumKind.CRC32, checksum=0))
        assert eventually(lambda: receiver.senders == 1 and receiver._pairs[b"raw"].in_flight == 1)  # type: ignore[attr-defined]
        senders.append(NcclKVSender(src, receiver.address, group_timeout_s=GROUP_TIMEOUT_S))  # no room now
        senders.append(ZmqKVSender(src, receiver.address))  # the other transport
        receiver.register("e", [7], expected_layers=1)
        for sender, why in zip(senders[2:], ("transfer in flight", "routing id")):
            start = time.monotonic()
            with pytest.raises(TransferError) as err:
                sender.send("e", 0, [0], [7], start + 3)
            assert err.value.reason is FailReason.PROTOCOL and why in err.value.detail, err.value
            assert time.monotonic() - start < 1.5
        assert (full[0, :, [6, 7]] == SENTINEL).all()
    finally:
        if rogue is not None:
            rogue.close()
        for sender in senders:
            sender.close()
        receiver.close()


def test_a_sender_refused_while_every_pair_is_busy_pairs_once_its_formation_gives_up() -> None:
    # A refusal at the bound (every pair with a transfer in flight) passes: the refused sender's sends fail
    # at once (PROTOCOL) until its own group formation gives up (`group_timeout_s`), then it pairs again,
    # in the place of the pair that was busy (broken by then: its tensor never came).
    src, _ = make_cache(1, 4, seed=1)
    dst, _ = make_cache(1, 8)
    receiver = NcclKVReceiver(dst, max_senders=1, group_timeout_s=1.0)
    rogue = RawPeer(receiver.address, routing_id=b"raw")  # pairs, then a header whose tensor never comes
    sender = None
    try:
        assert isinstance(rogue.hello(), KVCreditGrant)
        receiver.register("d", [6], expected_layers=1)
        rogue.send(KVTransferHeader(
            request_id="d", transfer_id=5, seq=0, layer=0, dst_block_ids=(6,), num_blocks=1, dtype="float16",
            block_shape=BLOCK, checksum_kind=ChecksumKind.CRC32, checksum=0))
        assert eventually(lambda: receiver._pairs[b"raw"].in_flight == 1)  # type: ignore[attr-defined]
        sender = NcclKVSender(src, receiver.address, group_timeout_s=1.0)
        receiver.register("e", [7], expected_layers=1)
        with pytest.raises(TransferError) as err:
            sender.send("e", 0, [0], [7], soon(2))
        assert err.value.reason is FailReason.PROTOCOL and "in flight" in err.value.detail
        start = time.monotonic()
        while True:  # bounded: the formation gives up within 1 s, the re-pair forms within the next
            receiver.register(rid := f"f{time.monotonic_ns()}", [5], expected_layers=1)
            try:
                sender.send(rid, 0, [1], [5], soon(3))
                sender.finish(rid, soon(3))
                break
            except TransferError:
                assert time.monotonic() - start < 8, "the refused sender never paired"
                time.sleep(0.2)
        assert receiver.wait(rid, soon(2)).state is TransferState.DONE and sender.num_repairs == 1
    finally:
        rogue.close()
        if sender is not None:
            sender.close()
        receiver.close()


def test_close_from_another_thread_ends_a_wait_for_the_data_channel_at_once(
        link: Links, monkeypatch: pytest.MonkeyPatch) -> None:
    # A send waits for the pair's data channel to form (at most the group timeout) holding the sender; the
    # prefill worker closing the link meanwhile must not wait that long (`close` is bounded, ~1 s).
    monkeypatch.setattr(NcclKVSender, "_start_forming", lambda self: _started(threading.Thread(target=lambda: None)))
    lk = link(layers=1, group_timeout_s=1.0)  # the receiver's side gives up forming it within the test
    lk.receiver.register("req", [3], expected_layers=1)
    assert eventually(lambda: lk.sender.credits > 0)  # type: ignore[attr-defined]  # granted: only the channel lacks
    close_while_waiting(lk.sender, lambda: lk.sender.send("req", 0, [0], [3], soon(6)))


def _started(thread: threading.Thread) -> threading.Thread:
    thread.start()
    return thread


def test_a_sender_without_a_receiver_times_out_at_its_deadline_and_closes_promptly() -> None:
    kv, _ = make_cache(1, 4, seed=1)
    with zmq.Context.instance().socket(zmq.ROUTER) as probe:  # a port nobody listens on
        probe.bind("tcp://127.0.0.1:*")
        address = probe.getsockopt_string(zmq.LAST_ENDPOINT)
    sender = NcclKVSender(kv, address, group_timeout_s=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(TransferError) as err:
            sender.send("req", 0, [0], [1], start + 0.3)
        assert err.value.reason is FailReason.TIMEOUT and 0.29 <= time.monotonic() - start < 0.8
        assert not sender.wait_ready(2)  # its rendezvous found no store to meet at
    finally:
        start = time.monotonic()
        sender.close()
        assert time.monotonic() - start < 1.5


# -- configuration ---------------------------------------------------------------------------------


def test_addresses_and_backends_are_checked() -> None:
    assert parse_address("tcp://127.0.0.1:5555") == ("127.0.0.1", 5555)
    assert parse_address("tcp://[::1]:5555") == ("::1", 5555)
    for bad in ("tcp://127.0.0.1", "ipc:///tmp/x", "tcp://h:x", "127.0.0.1:5"):
        with pytest.raises(ValueError, match="address"):
            parse_address(bad)
    kv, _ = make_cache(1, 4)
    with pytest.raises(ValueError, match="needs CUDA caches"):
        NcclKVReceiver(kv, backend="nccl")
    with pytest.raises(ValueError, match="backend"):
        NcclKVSender(kv, "tcp://127.0.0.1:1", backend="mpi")


# -- writes queued on a copy stream ----------------------------------------------------------------
# On a GPU the receiver's pair thread writes staging into the cache on a stream of its own and does not wait
# message by message; the ledger waits for those writes (their events) before a transfer ends in any way,
# since the decode engine then reads the blocks, or they go back to the pool. Here a stand-in event plays the
# queued write: it is over only when the test says so.


class _QueuedWrite:
    """Stands in for the CUDA event after a write queued on a copy stream."""

    def __init__(self) -> None:
        self.over = threading.Event()

    def query(self) -> bool:
        return self.over.is_set()


def _data_header(kind: ChecksumKind = ChecksumKind.NONE, **over: Any) -> KVTransferHeader:
    fields: dict[str, Any] = dict(request_id="req", transfer_id=5, seq=0, layer=0, dst_block_ids=(1,), num_blocks=1,
                                  dtype="float16", block_shape=BLOCK, checksum_kind=kind, checksum=0)
    fields.update(over)
    return KVTransferHeader(**fields)


_END = _data_header(seq=1, dst_block_ids=(), num_blocks=0, is_last=True)


@pytest.fixture
def queued(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ReceiverLedger, _QueuedWrite, np.ndarray]]:
    """A ledger whose every write counts as queued on a copy stream until `write.over` is set."""
    write = _QueuedWrite()
    monkeypatch.setattr(streams, "record", lambda device, side_only=False: write)
    kv, _ = make_cache(1, 4)
    ledger = ReceiverLedger(kv, writes_wait_s=0.5)
    ledger.register("req", [1], expected_layers=1)
    frame = np.full(frames.frame_bytes(ledger.geometry, 1) // 2, 7, dtype=np.uint8)
    assert ledger.apply(_data_header(), frame, frame, peer="p", verify=False).state is TransferState.PENDING
    yield ledger, write, frame
    write.over.set()


def _later(seconds: float, fn: Any) -> threading.Timer:
    timer = threading.Timer(seconds, fn)
    timer.start()
    return timer


def test_a_transfer_is_done_only_once_its_queued_writes_are_over(
        queued: tuple[ReceiverLedger, _QueuedWrite, np.ndarray]) -> None:
    ledger, write, _ = queued
    timer = _later(0.2, write.over.set)
    try:
        ack = ledger.apply(_END, frame := np.zeros(0, np.uint8), frame, peer="p", verify=False)
        assert ack.state is TransferState.DONE and write.over.is_set()
    finally:
        timer.cancel()


def test_an_abort_returns_once_the_queued_writes_are_over(
        queued: tuple[ReceiverLedger, _QueuedWrite, np.ndarray]) -> None:
    ledger, write, _ = queued
    timer = _later(0.2, write.over.set)
    try:
        ledger.abort("req", "cancelled")  # the caller frees the blocks next: nothing may still write them
        assert write.over.is_set()
    finally:
        timer.cancel()


def test_writes_that_never_end_fail_the_transfer_at_their_deadline(
        queued: tuple[ReceiverLedger, _QueuedWrite, np.ndarray]) -> None:
    ledger, write, _ = queued
    start = time.monotonic()
    ack = ledger.apply(_END, frame := np.zeros(0, np.uint8), frame, peer="p", verify=False)
    assert ack.reason is FailReason.INTERNAL and "not over" in ack.detail
    assert 0.5 <= time.monotonic() - start < 2.0 and not write.over.is_set()
