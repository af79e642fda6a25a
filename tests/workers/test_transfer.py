"""The KV transport, one conformance suite over every backend (in-process, ZeroMQ, and torch.distributed
through gloo on the CPU): the right bytes go into the right blocks, and every failure path ends in a clear
state at its deadline, with nothing wrong written into the cache. Then what only some backends do (credits,
message size, a socket that strangers can reach), and the frame helpers they share.

Network tests use loopback only; every wait has a deadline of a few seconds at most. What only the
torch.distributed backend does is in test_transfer_nccl.py.
"""

from __future__ import annotations

import pickle
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from kv_links import (
    BLOCK,
    SENTINEL,
    Exploit,
    Links,
    backend_params,
    close_while_waiting,
    eventually,
    header,
    make_cache,
    soon,
)

from pdserve.workers.messages import ChecksumKind, FailReason, TransferState, encode
from pdserve.workers.transfer import KVSender, TransferError, frames


@pytest.fixture(params=backend_params())
def link(request: pytest.FixtureRequest) -> Iterator[Links]:
    """Links over the backend of the test's parameter: every backend, unless the test names some
    (`@pytest.mark.parametrize("link", backend_params(...), indirect=True)`)."""
    made = Links(request.param)
    yield made
    made.close()


def network_only(test: object) -> object:
    """The test runs over the backends with credits and a message size (not the in-process one)."""
    return pytest.mark.parametrize("link", backend_params("zmq", "nccl"), indirect=True)(test)


# -- happy paths ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_moves_chosen_blocks_into_the_right_destination_blocks(link: Links, dtype: torch.dtype) -> None:
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
    # No backend creates a global default group (torch.distributed: per-pair groups only).
    assert not (dist.is_available() and dist.is_initialized())


def test_layers_stream_one_at_a_time_and_the_state_is_pending_until_the_last(link: Links) -> None:
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


def test_two_requests_interleave_on_one_link_and_big_sends_split_into_messages(link: Links) -> None:
    block_bytes = BLOCK[0] * BLOCK[1] * BLOCK[2] * 2  # K or V of one fp16 block
    lk = link(layers=2, max_message_bytes=2 * 2 * block_bytes)  # two blocks (K and V) per message, where it applies
    before = lk.dst.clone()
    lk.receiver.register("a", [0, 1, 2, 3, 4], expected_layers=2)
    lk.receiver.register("b", [9, 8], expected_layers=2)
    for layer in range(2):
        lk.sender.send("a", layer, [7, 6, 5, 4, 3], [0, 1, 2, 3, 4], soon(2))  # 3 messages
        lk.sender.send("b", layer, [0, 1], [9, 8], soon(2))
    lk.sender.finish("b", soon(3))
    lk.sender.finish("a", soon(3))
    assert lk.receiver.poll("a").state is lk.receiver.poll("b").state is TransferState.DONE
    lk.expect_moved(range(2), [7, 6, 5, 4, 3, 0, 1], [0, 1, 2, 3, 4, 9, 8], before)


# -- failure paths ----------------------------------------------------------------------------------


def test_corrupted_data_fails_with_checksum_and_writes_nothing_wrong(link: Links) -> None:
    lk = link(layers=3)
    src_ids, dst_ids = [0, 1], [8, 9]
    before, src_before = lk.dst.clone(), lk.src.clone()
    lk.receiver.register("req", dst_ids, expected_layers=3)
    lk.faults.corrupt(layer=1)  # one byte flipped in what is sent, after the checksum was taken
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
    assert torch.equal(lk.src, src_before)  # the byte was flipped in a copy or staging, not in the sender's cache


@pytest.mark.parametrize("kind", [k for k in ChecksumKind if k is not ChecksumKind.NONE])
def test_each_checksum_kind_moves_blocks_and_catches_a_flipped_byte(link: Links, kind: ChecksumKind) -> None:
    if kind not in frames.CHECKSUMS:
        pytest.skip(f"{kind.value} needs a package that is not installed")
    lk = link(layers=2, checksum=kind)
    before = lk.dst.clone()
    lk.receiver.register("good", [3, 4], expected_layers=2)
    lk.receiver.register("bad", [5], expected_layers=2)
    lk.send_layers("good", 2, [0, 1], [3, 4])
    if link.backend != "inprocess":  # a network sender uses the checksum the receiver named at hello
        assert lk.sender.checksum is kind  # type: ignore[attr-defined]
    lk.faults.corrupt(request_id="bad")
    lk.sender.send("bad", 0, [2], [5], soon(2))
    status = lk.receiver.wait("bad", soon(2))
    assert status.reason is FailReason.CHECKSUM and kind.value in status.detail
    lk.expect_moved(range(2), [0, 1], [3, 4], before)  # block 5 untouched


@pytest.mark.parametrize("lost", ["data", "end marker"])
def test_a_lost_message_makes_wait_time_out_at_its_deadline(link: Links, lost: str) -> None:
    lk = link(layers=3)
    lk.receiver.register("req", [3, 4], expected_layers=3)
    if lost == "data":
        lk.faults.drop(layer=1)  # nothing of it leaves (torch.distributed: neither its tensor nor its header)
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
    # The link still works (torch.distributed: layer 2's tensor after the lost layer 1 was matched to its own
    # header, so the two streams stayed aligned).
    lk.receiver.register("next", [10], expected_layers=1)
    lk.sender.send("next", 0, [5], [10], soon(2))
    lk.sender.finish("next", soon(2))
    assert torch.equal(lk.dst[0, :, 10], lk.src[0, :, 5])


def _finish_quietly(sender: KVSender, request_id: str, deadline: float) -> None:
    try:
        sender.finish(request_id, deadline)
    except TransferError:
        pass


def test_abort_by_the_sender_fails_the_receiver(link: Links) -> None:
    lk = link(layers=3)
    lk.receiver.register("req", [3, 4], expected_layers=3)
    lk.sender.send("req", 0, [0, 1], [3, 4], soon(2))
    lk.sender.abort("req", "client disconnected")
    status = lk.receiver.wait("req", soon(2))
    assert status.state is TransferState.FAILED and status.reason is FailReason.ABORTED
    assert "aborted by the sender: client disconnected" in status.detail
    lk.sender.abort("req", "again")  # idempotent


def test_closing_the_sender_aborts_its_unfinished_transfers(link: Links) -> None:
    lk = link(layers=2)
    lk.receiver.register("req", [3], expected_layers=2)
    lk.sender.send("req", 0, [0], [3], soon(2))
    lk.sender.close()
    status = lk.receiver.wait("req", soon(2))
    assert status.reason is FailReason.ABORTED and "sender closed" in status.detail


def test_abort_by_the_receiver_stops_the_sender_and_nothing_more_is_written(link: Links) -> None:
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


@pytest.mark.parametrize("link", backend_params("inprocess"), indirect=True)
def test_a_late_message_after_the_timeout_is_not_written(link: Links) -> None:
    # In-process only: it can hold a message back without blocking the sender (ZeroMQ keeps order).
    lk = link(layers=2)
    lk.receiver.register("req", [3, 4], expected_layers=2)
    lk.faults.delay(0.4, layer=1)
    before = lk.dst.clone()
    for layer in range(2):
        lk.sender.send("req", layer, [0, 1], [3, 4], soon(2))
    assert lk.receiver.wait("req", soon(0.1)).reason is FailReason.TIMEOUT
    time.sleep(0.6)  # the delayed layer 1 arrives now, to blocks the decode worker may have reused
    lk.expect_moved(range(1), [0, 1], [3, 4], before)


def test_refused_messages_leave_the_cache_alone_and_the_next_transfer_lands(link: Links) -> None:
    lk = link(layers=2)
    before = lk.dst.clone()
    lk.sender.send("nobody", 0, [0], [3], soon(2))  # an unregistered request
    with pytest.raises(TransferError) as err:
        lk.sender.finish("nobody", soon(2))
    assert err.value.reason is FailReason.UNKNOWN_REQUEST
    lk.receiver.register("req", [3, 4], expected_layers=2)
    lk.sender.send("req", 0, [0, 1], [3, 5], soon(2))  # block 5 belongs to someone else
    status = lk.receiver.wait("req", soon(2))
    assert status.reason is FailReason.PROTOCOL and "not registered" in status.detail
    assert torch.equal(lk.dst, before)
    lk.receiver.register("ok", [6], expected_layers=2)  # refused messages were still taken off the link
    lk.send_layers("ok", 2, [7], [6])
    lk.expect_moved(range(2), [7], [6], before)


def test_a_sender_that_finishes_early_fails_the_transfer(link: Links) -> None:
    lk = link(layers=3)
    lk.receiver.register("req", [3, 4], expected_layers=3)
    lk.sender.send("req", 0, [0, 1], [3, 4], soon(2))
    with pytest.raises(TransferError) as err:
        lk.sender.finish("req", soon(2))
    assert err.value.reason is FailReason.PROTOCOL and "layers [1, 2]" in err.value.detail


def test_mismatched_cache_geometry_is_refused_and_the_link_stays_usable(link: Links) -> None:
    lk = link(layers=2, src_block=(4, 2, 16))  # head dim 16 on the sender, 8 on the receiver
    for request_id in ("req", "next"):  # the second is refused for its shape too, not for a broken link
        lk.receiver.register(request_id, [3, 4], expected_layers=2)
        lk.sender.send(request_id, 0, [0, 1], [3, 4], soon(2))  # twice the bytes the receiver's blocks take
        status = lk.receiver.wait(request_id, soon(2))
        assert status.reason is FailReason.PROTOCOL and "block shape" in status.detail
        lk.receiver.release(request_id)
    assert (lk.dst == SENTINEL).all()


def test_bad_arguments_raise_value_errors(link: Links) -> None:
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


# -- network backends: flow control, message size, closing ----------------------------------------------


@network_only
def test_a_receiver_that_does_not_drain_blocks_the_sender_at_its_credit_window(link: Links) -> None:
    lk = link(layers=4, credits=2)
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
    assert eventually(lambda: lk.sender.credits == 2)  # type: ignore[attr-defined]  # every credit came back


@network_only
def test_a_layer_bigger_than_one_message_goes_in_several(link: Links) -> None:
    block_bytes = 2 * BLOCK[0] * BLOCK[1] * BLOCK[2] * 2  # K and V of one fp16 block
    lk = link(layers=2, credits=2, max_message_bytes=2 * block_bytes)  # 2 blocks a message, 2 in flight
    src_ids, dst_ids = [7, 0, 1, 2, 5], [19, 3, 4, 5, 12]
    before = lk.dst.clone()
    lk.receiver.register("req", dst_ids, expected_layers=2)
    lk.send_layers("req", 2, src_ids, dst_ids)  # 3 messages a layer: waits for credits mid-layer
    assert lk.receiver.poll("req").state is TransferState.DONE
    lk.expect_moved(range(2), src_ids, dst_ids, before)


@network_only
def test_finish_times_out_at_its_deadline_and_aborts_the_receiver(link: Links) -> None:
    lk = link(layers=1, credits=4)
    lk.receiver.register("req", [3], expected_layers=1)
    lk.faults.stall_receiver()
    lk.sender.send("req", 0, [0], [3], soon(2))
    start = time.monotonic()
    with pytest.raises(TransferError) as err:
        lk.sender.finish("req", start + 0.3)
    assert err.value.reason is FailReason.TIMEOUT and 0.29 <= time.monotonic() - start < 0.8
    status = lk.receiver.wait("req", soon(2))  # the abort is a control message: it passes a stalled receiver
    assert status.reason is FailReason.ABORTED and "sender gave up" in status.detail
    lk.faults.resume_receiver()


@network_only
def test_close_fails_pending_transfers_wakes_waiters_and_joins_every_thread(link: Links) -> None:
    lk = link(layers=2)
    lk.receiver.register("req", [3], expected_layers=2)
    lk.sender.send("req", 0, [0], [3], soon(2))
    assert eventually(lambda: torch.equal(lk.dst[0][:, 3], lk.src[0][:, 0]))
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(lk.receiver.wait("req", soon(5))))
    waiter.start()
    time.sleep(0.05)
    start = time.monotonic()
    lk.receiver.close()
    waiter.join(2)
    assert time.monotonic() - start < 2.5
    # The I/O thread (and torch.distributed's pair threads) stopped.
    assert not waiter.is_alive() and not lk.receiver.thread_alive  # type: ignore[attr-defined]
    assert result[0].reason is FailReason.CLOSED  # type: ignore[attr-defined]
    lk.receiver.close()  # idempotent
    start = time.monotonic()
    lk.sender.close()
    assert time.monotonic() - start < 1.5
    with pytest.raises(TransferError) as err:
        lk.sender.send("req", 1, [0], [3], soon(1))
    assert err.value.reason is FailReason.CLOSED
    lk.sender.close()  # idempotent


@network_only
def test_close_from_another_thread_ends_a_wait_on_the_receiver_at_once(link: Links) -> None:
    # The prefill worker closes a link (a role switch, shutdown) while the link's thread waits for a credit
    # from a decode worker that does not drain: `close` is bounded (~1 s), and the wait ends CLOSED, rather
    # than both lasting until that send's deadline (`--transfer-timeout`, 30 s).
    lk = link(layers=2, credits=1)
    lk.receiver.register("req", [3], expected_layers=2)
    lk.faults.stall_receiver()
    lk.sender.send("req", 0, [0], [3], soon(2))  # its one credit
    try:
        close_while_waiting(lk.sender, lambda: lk.sender.send("req", 1, [0], [3], soon(6)))
    finally:
        lk.faults.resume_receiver()


@pytest.mark.parametrize("link", backend_params("zmq"), indirect=True)
def test_the_receiver_survives_garbage_and_pickles_on_its_socket(link: Links, tmp_path: Path) -> None:
    import zmq

    lk = link(layers=1)
    marker = tmp_path / "pwned"
    rogue = zmq.Context.instance().socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(lk.receiver.address)  # type: ignore[attr-defined]
    try:
        rogue.send_multipart([pickle.dumps(Exploit(marker)), b"k", b"v"])
        rogue.send(b"\xff\x00garbage")
        rogue.send_multipart([encode(header(request_id="req")), b"\x00" * 8, b"\x00" * 8])  # no MAC, unregistered
        deadline = time.monotonic() + 5
        while lk.receiver.refusals.forged < 3 and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.01)
        assert lk.receiver.refusals.forged == 3  # type: ignore[attr-defined]
        assert not rogue.poll(100)  # dropped unanswered (not even decoded: it holds no MAC)
    finally:
        rogue.close()
    lk.receiver.register("req", [3], expected_layers=1)
    lk.sender.send("req", 0, [0], [3], soon(2))
    lk.sender.finish("req", soon(2))
    assert lk.receiver.poll("req").state is TransferState.DONE
    assert not marker.exists()


# -- frames: checksums and zero-copy views ---------------------------------------------------------


def test_the_receiver_picks_a_checksum_both_ends_compute() -> None:
    assert frames.pick_checksum(["blake9", "crc32"]) is ChecksumKind.CRC32  # unknown kinds are skipped
    assert frames.pick_checksum([]) is ChecksumKind.CRC32
    assert frames.pick_checksum([k.value for k in frames.CHECKSUMS]) is frames.CHECKSUMS[0]
    # No checksum only when neither end asks for one: the sender offers "none", the receiver does not verify.
    assert frames.pick_checksum(["none", "crc32"]) is ChecksumKind.CRC32
    assert frames.pick_checksum(["crc32"], verify=False) is ChecksumKind.CRC32
    assert frames.pick_checksum(["none", "crc32"], verify=False) is ChecksumKind.NONE


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
