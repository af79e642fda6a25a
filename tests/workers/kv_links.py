"""What the KV transport tests share: small caches, deadlines, and a sender/receiver pair ("link") over
any backend: in-process, ZeroMQ, or torch.distributed (`nccl_backend`, run through gloo on the CPU).

`test_transfer.py` runs the conformance cases over every backend with these; `test_transfer_nccl.py`
uses them for what only the torch.distributed backend does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from faults import Faults

from pdserve.workers.messages import (
    ChecksumKind,
    KVCreditGrant,
    KVTransferHeader,
    KVTransferHello,
    Message,
    decode,
    encode,
)
from pdserve.workers.transfer import FailReason, KVReceiver, KVSender, TransferError, auth, frames
from pdserve.workers.transfer.inprocess import InProcessReceiver, InProcessSender

try:
    from pdserve.workers.transfer import zmq_backend
except ImportError:  # pyzmq is optional; the in-process tests still run
    zmq_backend = None  # type: ignore[assignment]

BLOCK = (4, 2, 8)  # block_size, kv heads, head dim: small, so each test moves kilobytes
SENTINEL = -3.0  # what the receiver's cache holds where nothing may be written
GROUP_TIMEOUT_S = 3.0  # the torch.distributed backend's pair groups form (or give up) within this

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def soon(seconds: float) -> float:
    return time.monotonic() + seconds


def make_cache(num_layers: int, num_blocks: int, *, seed: int | None = None, dtype: torch.dtype = torch.float16,
               block: tuple[int, int, int] = BLOCK) -> tuple[KVCaches, torch.Tensor]:
    """Per layer (K, V) views into one [L, 2, NB, bs, H, D] tensor, as workers/kv/cache.py allocates them.

    Random values when seeded (a sender), else SENTINEL everywhere (a receiver)."""
    full = torch.full((num_layers, 2, num_blocks, *block), SENTINEL, dtype=dtype)
    if seed is not None:
        full.copy_(torch.randn(full.shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
    return [(full[i, 0], full[i, 1]) for i in range(num_layers)], full


def eventually(check: Callable[[], bool], seconds: float = 2.0) -> bool:
    """Poll `check` until true or `seconds` pass (network receivers apply messages on their own threads)."""
    end = soon(seconds)
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.005)
    return check()


def close_while_waiting(sender: KVSender, wait: Callable[[], None]) -> None:
    """`wait()` (a send that waits on the receiver, holding the sender's lock) on a thread of its
    own; `close` from here meanwhile must return within ~1 s and end that wait with CLOSED, not
    last until the send's deadline."""
    errors: list[TransferError] = []

    def run() -> None:
        try:
            wait()
        except TransferError as e:
            errors.append(e)

    waiter = threading.Thread(target=run)
    waiter.start()
    try:
        assert eventually(lambda: sender._lock.locked())  # type: ignore[attr-defined]  # waiting, holding it
        start = time.monotonic()
        sender.close()
        took = time.monotonic() - start
        waiter.join(7)
        assert took < 1.5, took
        assert not waiter.is_alive() and [e.reason for e in errors] == [FailReason.CLOSED]
    finally:
        waiter.join(7)


def header(**over: object) -> KVTransferHeader:
    """A valid data header; `over` replaces fields."""
    fields: dict[str, object] = dict(request_id="r1", transfer_id=7, seq=0, layer=2, dst_block_ids=(5, 9),
                                     num_blocks=2, dtype="float16", block_shape=(16, 8, 128),
                                     checksum_kind=ChecksumKind.CRC32, checksum=0xDEADBEEF)
    fields.update(over)
    return KVTransferHeader(**fields)  # type: ignore[arg-type]


class Exploit:
    """Unpickling this runs code: writes a file. decode() must never get that far."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


# -- links -------------------------------------------------------------------------------------------

BACKENDS = ("inprocess", "zmq", "nccl")


def unavailable(backend: str) -> str | None:
    """Why `backend` cannot run here; None if it can."""
    if backend == "zmq" and zmq_backend is None:
        return "pyzmq is not installed"
    if backend == "nccl" and not (dist.is_available() and dist.is_gloo_available()):
        return "torch.distributed with gloo is needed"
    return None


def backend_params(*backends: str) -> list[object]:
    """`backends` (default: all) as pytest params, each skipped where it cannot run."""
    return [pytest.param(b, id=b, marks=pytest.mark.skipif(unavailable(b) is not None, reason=unavailable(b) or ""))
            for b in backends or BACKENDS]


@dataclass
class Link:
    sender: KVSender
    receiver: KVReceiver
    src: torch.Tensor  # [L, 2, NB, bs, H, D] of the sender
    dst: torch.Tensor  # the same of the receiver, which has more blocks
    faults: Faults

    def send_layers(self, request_id: str, layers: int, src_ids: list[int], dst_ids: list[int],
                    finish_s: float = 2.0) -> None:
        """Send the blocks of layers 0 .. `layers - 1` (2 s each at most), then finish (`finish_s` at most)."""
        for layer in range(layers):
            self.sender.send(request_id, layer, src_ids, dst_ids, soon(2))
        self.sender.finish(request_id, soon(finish_s))

    def expect_moved(self, layers: range, src_ids: list[int], dst_ids: list[int], before: torch.Tensor) -> None:
        """Exactly the chosen blocks of the chosen layers changed, each to its source block (bit for bit)."""
        want = before.clone()
        want[layers.start : layers.stop, :, dst_ids] = self.src[layers.start : layers.stop, :, src_ids]
        assert torch.equal(self.dst, want)


@dataclass
class Links:
    """Makes links over one backend for one test; `close` closes them and checks no receiver thread is left."""

    backend: str
    made: list[Link] = field(default_factory=list)

    def __call__(self, *, layers: int = 3, src_blocks: int = 8, dst_blocks: int = 20, credits: int = 8,
                 dtype: torch.dtype = torch.float16, src_block: tuple[int, int, int] = BLOCK,
                 checksum: ChecksumKind = frames.CHECKSUMS[0], max_message_bytes: int | None = None,
                 verify: bool | tuple[bool | None, bool | None] | None = True, group_timeout_s: float = GROUP_TIMEOUT_S,
                 receive_limit: int = 1 << 20) -> Link:
        """A sender (8 blocks, random) and a receiver (20 blocks, all SENTINEL) with one `Faults` between them.

        The in-process backend has no credits nor message size; `verify` (both ends', a (sender, receiver)
        pair, or None: the backend's defaults), `group_timeout_s` and `receive_limit` (the receiver's
        `max_message_bytes`) are the torch.distributed backend's own."""
        src_kv, src = make_cache(layers, src_blocks, seed=1, dtype=dtype, block=src_block)
        dst_kv, dst = make_cache(layers, dst_blocks, dtype=dtype)
        faults = Faults()
        receiver: KVReceiver
        sender: KVSender
        if self.backend == "inprocess":
            receiver = InProcessReceiver(dst_kv)
            sender = InProcessSender(src_kv, receiver, faults=faults, checksum=checksum)  # type: ignore[arg-type]
        elif self.backend == "zmq":
            receiver = zmq_backend.ZmqKVReceiver(dst_kv, "tcp://127.0.0.1:*", credits=credits, faults=faults)
            sender = zmq_backend.ZmqKVSender(src_kv, receiver.address, faults=faults, checksums=[checksum],
                                             max_message_bytes=max_message_bytes or 2 << 20)
        else:
            from pdserve.workers.transfer.nccl_backend import NcclKVReceiver, NcclKVSender

            ends = (verify, verify) if not isinstance(verify, tuple) else verify
            sender_kw, receiver_kw = ({} if v is None else {"verify_checksums": v} for v in ends)
            receiver = NcclKVReceiver(dst_kv, credits=credits, group_timeout_s=group_timeout_s,
                                      max_message_bytes=receive_limit, faults=faults, **receiver_kw)
            sender = NcclKVSender(src_kv, receiver.address, checksums=[checksum],
                                  max_message_bytes=max_message_bytes or 16 << 20, group_timeout_s=group_timeout_s,
                                  faults=faults, **sender_kw)
        self.made.append(Link(sender, receiver, src, dst, faults))
        return self.made[-1]

    def close(self) -> None:
        for lk in self.made:
            lk.sender.close()
            lk.receiver.close()
            assert not getattr(lk.receiver, "thread_alive", False)


class RawPeer:
    """A DEALER that speaks a KV receiver's authenticated protocol by hand, message by message: a sender
    that holds `secret` but does what it likes (hostile-peer tests), or, with another secret, a stranger."""

    def __init__(self, address: str, secret: auth.ClusterSecret | None = None, routing_id: bytes | None = None,
                 fingerprint: str = "") -> None:
        import zmq

        self.secret = auth.resolve(secret)
        self.fingerprint = fingerprint
        self.sock: Any = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        self.sock.connect(address)
        self.nonce = auth.new_nonce()
        self.key: bytes | None = None
        self.tx = 1  # the hello's number
        self.rx = auth.SeqWindow()

    def hello(self, timeout_s: float = 2.0) -> Message | None:
        """Say hello; the receiver's answer (a grant, whose key then seals `send`; or a refusal), or None."""
        body = encode(KVTransferHello(sender_id="raw", checksums=("crc32",), nonce=self.nonce,
                                      fingerprint=self.fingerprint))
        self.sock.send_multipart([auth.seal(self.secret.derive(auth.KV_HELLO), auth.KV_HELLO, 1, [body]), body])
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        tag, reply = self.sock.recv_multipart()
        msg = decode(reply)
        if isinstance(msg, KVCreditGrant):
            self.key = auth.session_key(self.secret, self.nonce, msg.nonce)
            assert auth.check(self.key, auth.KV_TO_SENDER, tag, [reply]) is not None
        return msg

    def seal(self, msg: Message, *frames: bytes, seq: int | None = None) -> list[bytes]:
        """The parts of `msg` (and `frames` after it) under the connection's key, numbered next (or `seq`)."""
        assert self.key is not None, "hello first"
        if seq is None:
            self.tx += 1
            seq = self.tx
        body = [encode(msg), *frames]
        return [auth.seal(self.key, auth.KV_TO_RECEIVER, seq, body), *body]

    def send(self, msg: Message, *frames: bytes) -> list[bytes]:
        parts = self.seal(msg, *frames)
        self.sock.send_multipart(parts)
        return parts

    def recv(self, timeout_s: float = 2.0) -> Message | None:
        """The next message from the receiver (its MAC checked), or None within `timeout_s`."""
        assert self.key is not None
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        tag, body = self.sock.recv_multipart()
        seq = auth.check(self.key, auth.KV_TO_SENDER, tag, [body])
        assert seq is not None and self.rx.fresh(seq)
        self.rx.take(seq)
        return decode(body)

    def close(self) -> None:
        self.sock.close()
