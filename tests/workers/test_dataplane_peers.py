"""Hostile peers on the data plane (issue 16): whoever reaches a decode worker's KV port or a gateway's
token-stream port, and knows a request id, must not be able to write KV or put words into an answer.

Each case sends what an attacker would (no MAC, a wrong one, bytes altered after sealing, a replay,
an oversize frame, a hello from another model), checks that it is refused and counted, and that the
legitimate transfer or stream beside it still completes, byte for byte. Everything on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
import torch
from kv_links import RawPeer, eventually, make_cache, soon

zmq = pytest.importorskip("zmq")

from pdserve.cluster.token_collector import TokenStreamCollector  # noqa: E402
from pdserve.workers.messages import (  # noqa: E402
    ChecksumKind,
    FailReason,
    KVCreditGrant,
    KVHelloRefusal,
    KVTransferAck,
    KVTransferHeader,
    KVTransferHello,
    TokenDelta,
    TokenDeltaBatch,
    TransferState,
    encode,
)
from pdserve.workers.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pdserve.workers.token_stream import TokenStreamPublisher  # noqa: E402
from pdserve.workers.transfer import TransferError, auth, frames  # noqa: E402
from pdserve.workers.transfer.zmq_backend import ZmqKVReceiver, ZmqKVSender  # noqa: E402

BLOCK_BYTES = 4 * 2 * 8 * 2  # one block of K (or V) of kv_links' caches: block_size x heads x dim x fp16


def header(request_id: str, seq: int, layer: int, dst: tuple[int, ...], k: bytes, v: bytes,
           transfer_id: int = 77) -> KVTransferHeader:
    return KVTransferHeader(request_id=request_id, transfer_id=transfer_id, seq=seq, layer=layer, dst_block_ids=dst,
                            num_blocks=len(dst), dtype="float16", block_shape=(4, 2, 8),
                            checksum_kind=ChecksumKind.CRC32, checksum=frames.crc32(v, frames.crc32(k)))


def end_marker(request_id: str, seq: int, transfer_id: int = 77) -> KVTransferHeader:
    return KVTransferHeader(request_id=request_id, transfer_id=transfer_id, seq=seq, layer=0, dst_block_ids=(),
                            num_blocks=0, dtype="float16", block_shape=(4, 2, 8), checksum_kind=ChecksumKind.CRC32,
                            checksum=0, is_last=True)


def poison() -> bytes:
    return b"\x7f" * BLOCK_BYTES  # what an attacker would write into someone's blocks


# -- the KV port ------------------------------------------------------------------------------------


def test_forged_or_altered_kv_messages_are_refused_and_the_real_transfer_completes() -> None:
    src_kv, src = make_cache(2, 8, seed=1)
    dst_kv, dst = make_cache(2, 8)
    receiver = ZmqKVReceiver(dst_kv)
    sender = ZmqKVSender(src_kv, receiver.address)
    stranger = RawPeer(receiver.address, secret=auth.ClusterSecret.generate())  # another secret
    insider_gone_bad = RawPeer(receiver.address)  # our secret, but its bytes are changed on the way
    bare = zmq.Context.instance().socket(zmq.DEALER)
    bare.setsockopt(zmq.LINGER, 0)
    bare.connect(receiver.address)
    try:
        receiver.register("req", [3], expected_layers=2)
        h = header("req", 0, 0, (3,), poison(), poison())
        refusal = stranger.hello()  # its hello does not check: an unauthenticated refusal, no grant, no key
        assert isinstance(refusal, KVHelloRefusal) and "different cluster secrets" in refusal.reason
        stranger.key = stranger.secret.derive(b"guess")  # it seals with what it has
        stranger.send(h, poison(), poison())
        bare.send_multipart([encode(h), poison(), poison()])  # no MAC at all
        bare.send_multipart([os.urandom(auth.AUTH_FRAME_BYTES), encode(h), poison(), poison()])  # a made-up one
        assert isinstance(insider_gone_bad.hello(), KVCreditGrant)
        parts = insider_gone_bad.seal(h, poison(), poison())
        parts[2] = b"\x00" + parts[2][1:]  # K altered after the MAC was made
        insider_gone_bad.sock.send_multipart(parts)
        assert eventually(lambda: receiver.refusals.forged >= 5, 5.0), receiver.refusals
        assert receiver.refusals.forged == 5 and insider_gone_bad.recv(0.2) is None  # not even acked
        assert receiver.poll("req").state is TransferState.PENDING  # nothing bound the registration
        assert (dst[:, :, 3] == -3.0).all()  # nothing written

        for layer in range(2):
            sender.send("req", layer, [5], [3], soon(5))
        sender.finish("req", soon(5))
        assert receiver.poll("req").state is TransferState.DONE
        assert torch.equal(dst[:, :, 3], src[:, :, 5])
    finally:
        bare.close()
        stranger.close()
        insider_gone_bad.close()
        sender.close()
        receiver.close()


def test_a_replayed_kv_message_is_refused_on_its_own_connection_and_on_any_other() -> None:
    dst_kv, dst = make_cache(2, 8)
    receiver = ZmqKVReceiver(dst_kv)
    peer, other = RawPeer(receiver.address), RawPeer(receiver.address)
    try:
        assert isinstance(peer.hello(), KVCreditGrant) and isinstance(other.hello(), KVCreditGrant)
        receiver.register("req", [3], expected_layers=2)
        k0, v0 = os.urandom(BLOCK_BYTES), os.urandom(BLOCK_BYTES)
        recorded = peer.send(header("req", 0, 0, (3,), k0, v0), k0, v0)
        ack = peer.recv()
        assert isinstance(ack, KVTransferAck) and ack.state is TransferState.PENDING

        peer.sock.send_multipart(recorded)  # the same message again, on its connection: an old number
        other.sock.send_multipart(recorded)  # and on another connection: another key
        assert eventually(lambda: receiver.refusals.replayed == 1 and receiver.refusals.forged == 1, 5.0), \
            receiver.refusals
        # Had the replay reached the ledger, "seq 0 seen twice" would have failed the transfer.
        assert receiver.poll("req").state is TransferState.PENDING

        k1, v1 = os.urandom(BLOCK_BYTES), os.urandom(BLOCK_BYTES)
        peer.send(header("req", 1, 1, (3,), k1, v1), k1, v1)
        peer.send(end_marker("req", 2))
        assert receiver.wait("req", soon(5)).state is TransferState.DONE
        assert dst[0, 0, 3].numpy().tobytes() == k0 and dst[1, 1, 3].numpy().tobytes() == v1
    finally:
        peer.close()
        other.close()
        receiver.close()


def test_replayed_hellos_from_strangers_do_not_cut_off_a_live_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hello is sealed under a key every holder of the secret shares, so one recorded off the
    wire checks again from any new connection, without the secret. Each made a session, and past
    the receiver's bound the oldest was forgotten: replays pushed out a live prefill worker's key,
    and every message of its later transfers was refused as forged. (The bounds are made small
    here; the same happened at the real ones, 1,024 replays.)"""
    from pdserve.workers.transfer import control

    monkeypatch.setattr(control, "MAX_SESSIONS", 4)
    monkeypatch.setattr(control, "MAX_HALF_OPEN", 4)
    dst_kv, dst = make_cache(2, 8)
    receiver = ZmqKVReceiver(dst_kv)
    live = RawPeer(receiver.address)
    strangers: list[Any] = []
    try:
        assert isinstance(live.hello(), KVCreditGrant)
        receiver.register("before", [1], expected_layers=2)
        k, v = os.urandom(BLOCK_BYTES), os.urandom(BLOCK_BYTES)
        live.send(header("before", 0, 0, (1,), k, v), k, v)  # its first message: its key confirmed
        assert isinstance(live.recv(), KVTransferAck)
        recorder = RawPeer(receiver.address)
        body = encode(KVTransferHello(sender_id="raw", checksums=("crc32",), nonce=recorder.nonce))
        recorded = [auth.seal(auth.default_secret().derive(auth.KV_HELLO), auth.KV_HELLO, 1, [body]), body]
        recorder.close()
        for _ in range(16):  # one replay per new connection
            s = zmq.Context.instance().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(receiver.address)
            s.send_multipart(recorded)
            strangers.append(s)
        assert all(s.poll(5000) for s in strangers)  # each answered: its hello was taken
        receiver.register("after", [2], expected_layers=2)
        k, v = os.urandom(BLOCK_BYTES), os.urandom(BLOCK_BYTES)
        live.send(header("after", 0, 0, (2,), k, v), k, v)
        live.send(header("after", 1, 1, (2,), k, v), k, v)
        live.send(end_marker("after", 2))
        assert receiver.wait("after", soon(5)).state is TransferState.DONE, receiver.refusals
        assert receiver.refusals.forged == 0 and dst[1, 1, 2].numpy().tobytes() == v
    finally:
        for s in strangers:
            s.close()
        live.close()
        receiver.close()


def test_an_oversize_frame_drops_its_connection_before_it_is_read() -> None:
    src_kv, src = make_cache(2, 8, seed=1)
    dst_kv, dst = make_cache(2, 8)
    receiver = ZmqKVReceiver(dst_kv, max_frame_bytes=64 << 10)
    sender = ZmqKVSender(src_kv, receiver.address)
    flood = zmq.Context.instance().socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(receiver.address)
    try:
        assert sender.credits > 0 or eventually(lambda: sender.credits > 0)  # the real sender is connected
        flood.send_multipart([bytes(auth.AUTH_FRAME_BYTES), b"\x00" * (4 << 20)])  # 4 MiB > 64 KiB
        assert eventually(lambda: receiver.refusals.dropped >= 1, 5.0)
        assert receiver.refusals.forged == 0  # dropped by libzmq: never read, so never even MAC-checked
        receiver.register("req", [3], expected_layers=2)
        for layer in range(2):
            sender.send("req", layer, [5], [3], soon(5))
        sender.finish("req", soon(5))
        assert torch.equal(dst[:, :, 3], src[:, :, 5])
    finally:
        flood.close()
        sender.close()
        receiver.close()


def test_a_prefill_worker_of_another_model_is_refused_with_a_clear_error() -> None:
    src_kv, src = make_cache(2, 8, seed=1)
    dst_kv, dst = make_cache(2, 8)
    receiver = ZmqKVReceiver(dst_kv, fingerprint="model-a")
    wrong = ZmqKVSender(src_kv, receiver.address, fingerprint="model-b")
    right = ZmqKVSender(src_kv, receiver.address, fingerprint="model-a")
    try:
        receiver.register("req", [3], expected_layers=1)
        start = time.monotonic()
        with pytest.raises(TransferError) as err:
            wrong.send("req", 0, [5], [3], soon(10))
        assert err.value.reason is FailReason.PROTOCOL and time.monotonic() - start < 5
        assert "another model" in err.value.detail and "model-b" in err.value.detail
        assert "(an unauthenticated notice)" not in err.value.detail  # the refusal's MAC checked
        assert receiver.refusals.wrong_model == 1
        assert (dst == -3.0).all()
        right.send("req", 0, [5], [3], soon(5))
        right.finish("req", soon(5))
        assert torch.equal(dst[0, :, 3], src[0, :, 5])
    finally:
        wrong.close()
        right.close()
        receiver.close()


def test_a_sender_with_another_secret_fails_fast_and_says_why() -> None:
    src_kv, _ = make_cache(2, 8, seed=1)
    dst_kv, dst = make_cache(2, 8)
    receiver = ZmqKVReceiver(dst_kv)
    sender = ZmqKVSender(src_kv, receiver.address, secret=auth.ClusterSecret.generate())
    try:
        receiver.register("req", [3], expected_layers=1)
        with pytest.raises(TransferError) as err:
            sender.send("req", 0, [5], [3], soon(10))
        assert err.value.reason is FailReason.PROTOCOL and "different cluster secrets" in err.value.detail
        assert receiver.refusals.forged == 1 and (dst == -3.0).all()
    finally:
        sender.close()
        receiver.close()


# -- the token stream --------------------------------------------------------------------------------


def _delta(request_id: str, offset: int, tokens: tuple[int, ...], text: str, final: bool = False) -> TokenDelta:
    return TokenDelta(request_id, offset, tokens, text, "length" if final else None, None, None, 0, None, None)


async def _collect(collector: TokenStreamCollector, request_id: str) -> list[RequestOutput]:
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return [out async for out in collector.consume(request_id, collector.watch(request_id, done))]


def _push(address: str) -> Any:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    return sock


def test_tokens_injected_for_a_known_request_id_never_reach_its_answer() -> None:
    async def run() -> None:
        collector = TokenStreamCollector()
        collector.open("victim", [1, 2], 10.0)
        attacker = _push(collector.address)
        evil = encode(TokenDeltaBatch(worker_id="w#evil", seq=0, deltas=(_delta("victim", 0, (666,), "EVIL", True),)))
        attacker.send(evil)  # no MAC
        attacker.send_multipart([auth.token_tag(auth.ClusterSecret.generate(), collector.address, evil), evil])
        # Signed with our secret, but for another gateway's stream: it does not check here either.
        attacker.send_multipart([auth.token_tag(auth.default_secret(), "tcp://127.0.0.1:1", evil), evil])
        attacker.send_multipart([os.urandom(auth.TAG_BYTES), evil])
        for _ in range(500):
            if collector.num_forged >= 4:
                break
            await asyncio.sleep(0.01)
        assert collector.num_forged == 4

        publisher = TokenStreamPublisher("w")  # the real worker
        publisher.add(collector.address, RequestOutput("victim", None, [1, 2], [_completion((7,), "hi")], False), 0)
        publisher.add(collector.address, RequestOutput("victim", None, [1, 2], [_completion((8,), "!", "length")],
                                                       True), 1)
        publisher.flush()
        outs = await asyncio.wait_for(_collect(collector, "victim"), 10)
        assert [t for o in outs for t in o.outputs[0].token_ids] == [7, 8]
        assert "".join(o.outputs[0].text for o in outs) == "hi!"
        publisher.close()
        attacker.close()
        await collector.close()

    asyncio.run(run())


def test_a_replayed_token_batch_is_refused() -> None:
    async def run() -> None:
        collector = TokenStreamCollector()
        collector.open("r", [1], 10.0)
        sock = _push(collector.address)
        secret = auth.default_secret()

        def signed(batch: TokenDeltaBatch) -> list[bytes]:
            body = encode(batch)
            return [auth.token_tag(secret, collector.address, body), body]

        first = signed(TokenDeltaBatch(worker_id="w#1", seq=0, deltas=(_delta("r", 0, (5,), "a"),)))
        sock.send_multipart(first)
        sock.send_multipart(first)  # recorded and sent again
        sock.send_multipart(signed(TokenDeltaBatch(worker_id="w#1", seq=1, deltas=(_delta("r", 1, (6,), "b", True),))))
        outs = await asyncio.wait_for(_collect(collector, "r"), 10)
        assert [t for o in outs for t in o.outputs[0].token_ids] == [5, 6]
        assert collector.num_replayed == 1 and collector.num_gaps == 0
        sock.close()
        await collector.close()

    asyncio.run(run())


def test_an_oversize_frame_on_the_token_stream_drops_that_connection_only() -> None:
    async def run() -> None:
        collector = TokenStreamCollector()
        collector.open("r", [1], 10.0)
        flood = _push(collector.address)
        flood.send_multipart([bytes(auth.TAG_BYTES), b"\x00" * (4 << 20)])  # over the 1 MiB message limit
        for _ in range(500):
            if collector.num_dropped >= 1:
                break
            await asyncio.sleep(0.01)
        assert collector.num_dropped >= 1 and collector.num_forged == 0  # never read
        publisher = TokenStreamPublisher("w")
        publisher.add(collector.address, RequestOutput("r", None, [1], [_completion((9,), "z", "length")], True), 0)
        publisher.flush()
        outs = await asyncio.wait_for(_collect(collector, "r"), 10)
        assert [t for o in outs for t in o.outputs[0].token_ids] == [9]
        publisher.close()
        flood.close()
        await collector.close()

    asyncio.run(run())


def _completion(tokens: tuple[int, ...], text: str, finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(0, text, list(tokens), None, None, finish, None)


# -- what workers export ------------------------------------------------------------------------------


def test_workers_export_what_their_data_plane_refused() -> None:
    from pdserve.cluster.worker_metrics import Pool, WorkerCounts, WorkerMetrics

    counts = WorkerCounts(dataplane_refused=auth.RefusalCounts(forged=3, replayed=1, wrong_model=2, dropped=4))
    text = WorkerMetrics(Pool.DECODE, "d0", counts=lambda: counts).render().decode()
    for reason, value in (("forged", 3), ("replayed", 1), ("wrong_model", 2), ("dropped", 4)):
        assert f'pdserve:dataplane_refused_total{{pool="decode",reason="{reason}",worker="d0"}} {value}.0' in text


def test_workers_export_what_their_request_inbox_refused() -> None:
    from pdserve.cluster.worker_metrics import Pool, WorkerCounts, WorkerMetrics

    counts = WorkerCounts(inbox_refused=(5, 2, 1))
    text = WorkerMetrics(Pool.COLOCATED, "w0", counts=lambda: counts).render().decode()
    for reason, value in (("forged", 5), ("replayed", 2), ("malformed", 1)):
        assert f'pdserve:inbox_refused_total{{pool="colocated",reason="{reason}",worker="w0"}} {value}.0' in text


def test_the_secret_never_shows_in_a_repr_and_travels_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.workers.config import EngineConfig

    secret = auth.ClusterSecret.from_text("ab" * 32)
    assert secret.key == bytes.fromhex("ab" * 32)
    for shown in (repr(secret), str(secret), repr(ServeConfig(EngineConfig("/m"), cluster_secret=secret))):
        assert "ab" * 4 not in shown and "abab" not in shown
    assert pickle.loads(pickle.dumps(secret)) == secret
    assert ServeConfig(EngineConfig("/m")).cluster_secret != ServeConfig(EngineConfig("/m")).cluster_secret
    with pytest.raises(ValueError):
        auth.ClusterSecret(b"short")


def test_the_model_fingerprint_tells_checkpoints_and_configs_apart(tmp_path: Any) -> None:
    from pdserve.workers.transfer.fingerprint import module_fingerprint

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16))

    (tmp_path / "config.json").write_text('{"hidden_size": 16}')
    base = module_fingerprint(str(tmp_path), model(0))
    assert module_fingerprint(str(tmp_path), model(0)) == base  # the same model, loaded again
    assert module_fingerprint(str(tmp_path), model(1)) != base  # another checkpoint of the same shapes
    tuned = model(0)
    with torch.no_grad():
        tuned[1].weight.view(-1)[3] += 1.0  # a fine-tune that moved sampled bytes
    assert module_fingerprint(str(tmp_path), tuned) != base
    (tmp_path / "config.json").write_text('{"hidden_size": 16, "rope_theta": 1e6}')
    assert module_fingerprint(str(tmp_path), model(0)) != base  # same weights, another config
