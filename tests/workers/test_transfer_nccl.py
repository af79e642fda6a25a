"""The torch.distributed KV transport (`nccl_backend`), run through gloo on the CPU.

The same code path as NCCL on GPUs, minus the device: per-pair two-rank groups built
without `init_process_group`, the tensor of each message posted before its ZeroMQ header,
checksums and the shared ledger on the receiver. Sender and receiver live in this process on
different threads (their groups rendezvous through the receiver's TCPStore over loopback), and
one test runs the sender in a second process. Every wait has a deadline of a few seconds.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import zmq

from pdserve.workers.messages import (
    ChecksumKind,
    FailReason,
    KVCreditGrant,
    KVTransferHeader,
    KVTransferHello,
    TransferState,
    decode,
    encode,
)
from pdserve.workers.transfer import TransferError, frames
from pdserve.workers.transfer.faults import Faults
from pdserve.workers.transfer.nccl_backend import NcclKVReceiver, NcclKVSender, parse_address

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")

BLOCK = (4, 2, 8)  # block_size, kv heads, head dim: small, so each test moves kilobytes
SENTINEL = -3.0  # what the receiver's cache holds where nothing may be written
GROUP_TIMEOUT_S = 3.0


def soon(seconds: float) -> float:
    return time.monotonic() + seconds


def make_cache(num_layers: int, num_blocks: int, *, seed: int | None = None, dtype: torch.dtype = torch.float16,
               block: tuple[int, int, int] = BLOCK) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Per layer (K, V) views into one [L, 2, NB, bs, H, D] tensor; random when seeded (a sender), else SENTINEL."""
    full = torch.full((num_layers, 2, num_blocks, *block), SENTINEL, dtype=dtype)
    if seed is not None:
        full.copy_(torch.randn(full.shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
    return [(full[i, 0], full[i, 1]) for i in range(num_layers)], full


def eventually(check: Callable[[], bool], seconds: float = 2.0) -> bool:
    end = soon(seconds)
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.005)
    return check()


@dataclass
class Link:
    sender: NcclKVSender
    receiver: NcclKVReceiver
    src: torch.Tensor
    dst: torch.Tensor
    faults: Faults

    def expect_moved(self, layers: range, src_ids: list[int], dst_ids: list[int], before: torch.Tensor) -> None:
        """Exactly the chosen blocks of the chosen layers changed, each to its source block (bit for bit)."""
        want = before.clone()
        want[layers.start : layers.stop, :, dst_ids] = self.src[layers.start : layers.stop, :, src_ids]
        assert torch.equal(self.dst, want)


LinkFactory = Callable[..., Link]


@pytest.fixture
def link() -> Iterator[LinkFactory]:
    made: list[Link] = []

    def make(*, layers: int = 3, src_blocks: int = 8, dst_blocks: int = 20, credits: int = 8,
             dtype: torch.dtype = torch.float16, src_block: tuple[int, int, int] = BLOCK,
             checksum: ChecksumKind = frames.CHECKSUMS[0], verify: bool = True, max_message_bytes: int = 16 << 20,
             group_timeout_s: float = GROUP_TIMEOUT_S, receive_limit: int = 1 << 20) -> Link:
        src_kv, src = make_cache(layers, src_blocks, seed=1, dtype=dtype, block=src_block)
        dst_kv, dst = make_cache(layers, dst_blocks, dtype=dtype)
        faults = Faults()
        receiver = NcclKVReceiver(dst_kv, credits=credits, verify_checksums=verify, group_timeout_s=group_timeout_s,
                                  max_message_bytes=receive_limit, faults=faults)
        sender = NcclKVSender(src_kv, receiver.address, checksums=[checksum], verify_checksums=verify,
                              max_message_bytes=max_message_bytes, group_timeout_s=group_timeout_s, faults=faults)
        made.append(Link(sender, receiver, src, dst, faults))
        return made[-1]

    yield make
    for lk in made:
        lk.sender.close()
        lk.receiver.close()
        assert not lk.receiver.thread_alive


# -- happy paths ------------------------------------------------------------------------------


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
    assert not dist.is_initialized()  # per-pair groups only: no global default group was created


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


def test_two_requests_interleave_and_big_sends_split_into_messages(link: LinkFactory) -> None:
    block_bytes = 4 * 2 * 8 * 2
    lk = link(layers=2, max_message_bytes=2 * 2 * block_bytes)  # two blocks (K and V) per message
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


def test_without_checksums_the_ledger_still_decides_what_is_written(link: LinkFactory) -> None:
    # verify_checksums=False is the GPU fast path (no device-to-host copy); on the CPU it runs the same code.
    lk = link(layers=2, verify=False)
    before = lk.dst.clone()
    lk.receiver.register("req", [3, 4], expected_layers=2)
    lk.receiver.register("other", [7], expected_layers=1)
    for layer in range(2):
        lk.sender.send("req", layer, [5, 2], [3, 4], soon(2))
    lk.sender.finish("req", soon(3))
    assert lk.receiver.poll("req").state is TransferState.DONE
    lk.expect_moved(range(2), [5, 2], [3, 4], before)
    lk.sender.send("other", 0, [0, 1], [7, 8], soon(2))  # block 8 is not registered for it
    status = lk.receiver.wait("other", soon(2))
    assert status.reason is FailReason.PROTOCOL and "not registered" in status.detail
    lk.expect_moved(range(2), [5, 2], [3, 4], before)


def test_the_sender_can_live_in_another_process(link: LinkFactory) -> None:
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
    done = subprocess.run([sys.executable, "-c", script, lk.receiver.address], capture_output=True, text=True,
                          timeout=9)
    assert done.returncode == 0 and "sent" in done.stdout, done.stderr[-2000:]
    assert lk.receiver.wait("req", soon(2)).state is TransferState.DONE
    lk.expect_moved(range(3), src_ids, dst_ids, before)
    assert lk.receiver.senders == 2  # the fixture's sender and the other process's, each its own pair


# -- failure paths ------------------------------------------------------------------------------


def test_corrupted_data_fails_with_checksum_and_writes_nothing_wrong(link: LinkFactory) -> None:
    lk = link(layers=3)
    src_ids, dst_ids = [0, 1], [8, 9]
    before, src_before = lk.dst.clone(), lk.src.clone()
    lk.receiver.register("req", dst_ids, expected_layers=3)
    lk.faults.corrupt(layer=1)  # one byte flipped in the sent tensor, after the checksum was taken
    raised = None
    for layer in range(3):
        try:
            lk.sender.send("req", layer, src_ids, dst_ids, soon(2))
        except TransferError as e:  # the receiver's verdict may already be back
            raised = e
            break
    status = lk.receiver.wait("req", soon(2))
    assert status.state is TransferState.FAILED and status.reason is FailReason.CHECKSUM
    assert "!= header's" in status.detail
    lk.expect_moved(range(1), src_ids, dst_ids, before)  # layer 0 intact; the bad layer and later untouched
    if raised is None:
        with pytest.raises(TransferError) as err:
            lk.sender.finish("req", soon(2))
        raised = err.value
    assert raised.reason is FailReason.CHECKSUM
    assert torch.equal(lk.src, src_before)  # the byte was flipped in the sender's staging, not in its cache


@pytest.mark.parametrize("kind", list(ChecksumKind))
def test_each_checksum_kind_catches_a_flipped_byte(link: LinkFactory, kind: ChecksumKind) -> None:
    if kind not in frames.CHECKSUMS:
        pytest.skip(f"{kind.value} needs a package that is not installed")
    lk = link(layers=2, checksum=kind)
    before = lk.dst.clone()
    lk.receiver.register("good", [3, 4], expected_layers=2)
    lk.receiver.register("bad", [5], expected_layers=2)
    for layer in range(2):
        lk.sender.send("good", layer, [0, 1], [3, 4], soon(2))
    lk.sender.finish("good", soon(2))
    assert lk.sender.checksum is kind
    lk.faults.corrupt(request_id="bad")
    lk.sender.send("bad", 0, [2], [5], soon(2))
    status = lk.receiver.wait("bad", soon(2))
    assert status.reason is FailReason.CHECKSUM and kind.value in status.detail
    lk.expect_moved(range(2), [0, 1], [3, 4], before)  # block 5 untouched


@pytest.mark.parametrize("lost", ["data", "end marker"])
def test_a_lost_message_makes_wait_time_out_at_its_deadline(link: LinkFactory, lost: str) -> None:
    lk = link(layers=3)
    lk.receiver.register("req", [3, 4], expected_layers=3)
    if lost == "data":
        lk.faults.drop(layer=1)  # neither its tensor nor its header leaves
    else:
        lk.faults.drop(end_marker=True)
    for layer in range(3):
        lk.sender.send("req", layer, [0, 1], [3, 4], soon(2))
    finisher = threading.Thread(target=_finish_quietly, args=(lk.sender, "req", soon(2.0)))
    if lost == "end marker":
        finisher.start()
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
    # Layer 2's tensor after the lost layer 1 was still matched to its own header: the streams stayed aligned.
    lk.receiver.register("next", [10], expected_layers=1)
    lk.sender.send("next", 0, [5], [10], soon(2))
    lk.sender.finish("next", soon(2))
    assert torch.equal(lk.dst[0, :, 10], lk.src[0, :, 5])


def _finish_quietly(sender: NcclKVSender, request_id: str, deadline: float) -> None:
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
        lk.receiver.poll("req")


def test_refused_messages_are_still_received_so_the_next_transfer_lands(link: LinkFactory) -> None:
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
    lk.receiver.register("ok", [6], expected_layers=2)
    for layer in range(2):
        lk.sender.send("ok", layer, [7], [6], soon(2))
    lk.sender.finish("ok", soon(2))
    lk.expect_moved(range(2), [7], [6], before)


def test_mismatched_cache_geometry_is_refused_and_the_channel_stays_aligned() -> None:
    src_kv, _ = make_cache(2, 8, seed=1, block=(4, 2, 16))  # head dim 16 on the sender, 8 on the receiver
    dst_kv, dst = make_cache(2, 20)
    receiver = NcclKVReceiver(dst_kv, group_timeout_s=GROUP_TIMEOUT_S)
    sender = NcclKVSender(src_kv, receiver.address, group_timeout_s=GROUP_TIMEOUT_S)
    try:
        for request_id in ("req", "next"):  # the second is refused for its shape too, not for a broken channel
            receiver.register(request_id, [3, 4], expected_layers=2)
            sender.send(request_id, 0, [0, 1], [3, 4], soon(2))  # twice the bytes the receiver's blocks take
            status = receiver.wait(request_id, soon(2))
            assert status.reason is FailReason.PROTOCOL and "block shape" in status.detail
            receiver.release(request_id)
        assert (dst == SENTINEL).all()
    finally:
        sender.close()
        receiver.close()
    assert not receiver.thread_alive


def test_a_receiver_that_does_not_drain_blocks_the_sender_at_its_credit_window(link: LinkFactory) -> None:
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
    assert torch.equal(lk.dst, before)
    lk.faults.resume_receiver()
    lk.sender.send("req", 2, src_ids, dst_ids, soon(2))  # the retry gets the returned credits
    lk.sender.send("req", 3, src_ids, dst_ids, soon(2))
    lk.sender.finish("req", soon(2))
    assert lk.receiver.poll("req").state is TransferState.DONE
    lk.expect_moved(range(4), src_ids, dst_ids, before)
    assert eventually(lambda: lk.sender.credits == 2)


def test_finish_times_out_at_its_deadline_and_aborts_the_receiver(link: LinkFactory) -> None:
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


def test_a_sender_whose_data_channel_never_forms_fails_its_transfers_with_closed(link: LinkFactory) -> None:
    # A peer that says hello but never joins its group: the receiver's side gives up at the group timeout,
    # and every message from that peer then fails its transfer instead of waiting for bytes that never come.
    lk = link(layers=1, group_timeout_s=0.5)
    rogue = zmq.Context.instance().socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.setsockopt(zmq.ROUTING_ID, b"rogue")
    rogue.connect(lk.receiver.address)
    try:
        rogue.send(encode(KVTransferHello(sender_id="rogue", checksums=("crc32",))))
        assert rogue.poll(2000)
        assert isinstance(decode(rogue.recv()), KVCreditGrant)
        lk.receiver.register("req", [3], expected_layers=1)
        time.sleep(0.7)  # past the receiver's group timeout
        rogue.send(encode(KVTransferHeader(
            request_id="req", transfer_id=5, seq=0, layer=0, dst_block_ids=(3,), num_blocks=1, dtype="float16",
            block_shape=BLOCK, checksum_kind=ChecksumKind.CRC32, checksum=0)))
        assert rogue.poll(2000)
        ack = decode(rogue.recv())
        assert ack.reason is FailReason.CLOSED  # type: ignore[attr-defined]
    finally:
        rogue.close()
    status = lk.receiver.poll("req")
    assert status.reason is FailReason.CLOSED and "not formed" in status.detail
    assert (lk.dst == SENTINEL).all()


def test_a_recv_whose_tensor_never_comes_ends_at_the_group_timeout(link: LinkFactory) -> None:
    # A sender stuck mid-message: its header arrived, its tensor does not. gloo cannot cancel the posted recv;
    # the group's timeout ends it, which breaks the pair, and the transfer fails instead of hanging.
    lk = link(layers=1, group_timeout_s=1.0)
    assert lk.sender.wait_ready(2)
    lk.receiver.register("req", [3], expected_layers=1)
    lk.receiver.register("other", [4], expected_layers=1)
    header = KVTransferHeader(request_id="req", transfer_id=5, seq=0, layer=0, dst_block_ids=(3,), num_blocks=1,
                              dtype="float16", block_shape=BLOCK, checksum_kind=ChecksumKind.CRC32, checksum=0)
    lk.sender._sock.send(encode(header))  # the header alone, behind the sender's back
    start = time.monotonic()
    time.sleep(0.1)
    lk.receiver.abort("other")  # the API stays responsive while the pair thread waits
    assert time.monotonic() - start < 0.5
    status = lk.receiver.wait("req", soon(3))
    took = time.monotonic() - start
    assert status.reason is FailReason.CLOSED and "recv failed" in status.detail
    assert 0.9 <= took < 2.0, took
    assert (lk.dst == SENTINEL).all()


def test_a_broken_pair_fails_fast_on_both_sides_and_never_hangs_the_sender(link: LinkFactory) -> None:
    # A header announcing more than the receiver will stage cannot be received, so the pair is broken for
    # good: the transfer fails with CLOSED, and the sender, told so in the ack, shuts its side instead of
    # waiting on a send that no one will ever take.
    lk = link(layers=2, receive_limit=64)  # one block's K and V are 256 bytes
    lk.receiver.register("req", [3], expected_layers=2)
    lk.sender.send("req", 0, [0], [3], soon(2))
    status = lk.receiver.wait("req", soon(2))
    assert status.reason is FailReason.CLOSED and "cannot be received" in status.detail
    start = time.monotonic()
    with pytest.raises(TransferError) as err:
        lk.sender.finish("req", soon(2))
    assert err.value.reason is FailReason.CLOSED and time.monotonic() - start < 1.0
    lk.receiver.register("next", [4], expected_layers=1)
    with pytest.raises(TransferError) as err:
        lk.sender.send("next", 0, [1], [4], soon(2))
    assert err.value.reason is FailReason.CLOSED and "broken" in err.value.detail
    assert (lk.dst == SENTINEL).all()


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


def test_close_fails_pending_transfers_wakes_waiters_and_joins_every_thread(link: LinkFactory) -> None:
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
    assert not waiter.is_alive() and not lk.receiver.thread_alive  # the I/O thread and the pair thread
    assert result[0].reason is FailReason.CLOSED  # type: ignore[attr-defined]
    lk.receiver.close()  # idempotent
    start = time.monotonic()
    lk.sender.close()
    assert time.monotonic() - start < 1.5
    with pytest.raises(TransferError) as err:
        lk.sender.send("req", 1, [0], [3], soon(1))
    assert err.value.reason is FailReason.CLOSED
    lk.sender.close()


# -- configuration -------------------------------------------------------------------------------


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
